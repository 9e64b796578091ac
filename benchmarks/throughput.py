"""Offline throughput, after vLLM's benchmark_throughput.py, with Hugging Face transformers as the
yardstick on the same weights and the same prompts.

Where it sits: outside the engine, on top of the offline `LLM` API, like a user would drive it.
Random token-id prompts of one length keep the comparison honest: no tokenizer time on either
side, no padding in the transformers batch, and greedy decoding with EOS ignored so that both
produce exactly `--output-len` tokens per prompt. Only the generate calls are timed; engine and
model start-up are reported apart (start-up includes jaxserve's bucket precompilation).

    python benchmarks/throughput.py --num-prompts 8 --input-len 32 --output-len 32 [engine flags]

`--sampling-costs` also times, in the same engine and on the same prompts, greedy decoding
with penalties (presence, frequency, repetition) and with logprobs=5 and with prompt_logprobs=1, and reports each
against plain greedy (each variant's step is compiled in a short warm-up first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

from jaxserve.cli import ArgumentParser, add_engine_args, engine_args_from_namespace, make_llm, parse_args


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="benchmarks/throughput.py",
        description="Offline generation throughput of jaxserve, against transformers on the same weights.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--input-len", type=int, default=128, help="Prompt length in tokens.")
    parser.add_argument("--output-len", type=int, default=128, help="Generated tokens per prompt.")
    parser.add_argument("--num-prompts", type=int, default=64, help="Number of prompts, all in one batch.")
    parser.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    parser.add_argument(
        "--hf-baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Also run transformers' generate on the same prompts (needs torch).",
    )
    parser.add_argument(
        "--hf-num-threads",
        type=int,
        default=None,
        help="torch.set_num_threads for the baseline; unset = torch's default (one per core). On a "
        "loaded machine OpenMP threads that busy-wait for a busy core can slow torch tenfold; 1 avoids it.",
    )
    parser.add_argument(
        "--sampling-costs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Also time penalties, logprobs=5 and prompt_logprobs=1 against plain greedy decoding, same "
        "engine, same prompts.",
    )
    # --seed (the engine's) also seeds the random prompts, as in vLLM.
    add_engine_args(parser, model_positional=False)
    return parser


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> np.ndarray:
    """Token ids clear of the special and byte tokens that sit at the ends of most vocabularies."""
    if vocab_size <= 200:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids in [100, vocab_size - 100).")
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab_size - 100, size=(num_prompts, input_len), dtype=np.int64)


def throughput(num_prompts: int, prompt_tokens: int, output_tokens: int, elapsed: float) -> dict:
    return {
        "elapsed": elapsed,
        "num_prompts": num_prompts,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_second": num_prompts / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def run_jaxserve(ns: argparse.Namespace, engine_args) -> tuple[dict, object]:
    from jaxserve.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = make_llm(engine_args)
    startup = time.perf_counter() - start
    model_config = llm.llm_engine.config.model_config
    prompts = random_prompts(ns.num_prompts, ns.input_len, int(model_config.get("vocab_size")), ns.seed)
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    requests = [{"prompt_token_ids": row.tolist()} for row in prompts]
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    result = throughput(len(requests), prompts.size, output_tokens, elapsed)
    result["startup_s"] = startup
    return result, llm


SAMPLING_VARIANTS = {
    "plain": {},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "logprobs5": {"logprobs": 5},
    "prompt_logprobs1": {"prompt_logprobs": 1},
}


def run_sampling_costs(llm, requests: list[dict], output_len: int, rounds: int = 2) -> dict:
    """Output tokens/s of each SAMPLING_VARIANTS entry (best of `rounds`), and its ratio to
    plain greedy."""
    from jaxserve.sampling_params import SamplingParams

    variants = {
        name: SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, **extra)
        for name, extra in SAMPLING_VARIANTS.items()
    }
    for params in variants.values():
        llm.generate(requests, params.clone(max_tokens=2), use_tqdm=False)  # compile each variant
    results = {name: {"elapsed": float("inf")} for name in variants}
    for _ in range(rounds):  # interleaved rounds, best of each: less at the mercy of a noisy machine
        for name, params in variants.items():
            start = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            if elapsed < results[name]["elapsed"]:
                tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
                results[name] = {"elapsed": elapsed, "output_tokens_per_second": tokens / elapsed}
    for r in results.values():
        r["ratio_to_plain"] = r["output_tokens_per_second"] / results["plain"]["output_tokens_per_second"]
    return results


def run_transformers(
    model_path: str, prompts: np.ndarray, output_len: int, pad_token_id: int, num_threads: int | None = None
) -> dict:
    """The same greedy batch through transformers on CPU/float32, the project's reference."""
    try:
        import torch
        import transformers
        from packaging.version import Version
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise SystemExit(
            f"the transformers baseline needs torch ({e}); install jaxserve[test] or pass --no-hf-baseline"
        ) from None
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    # transformers 4.56 renamed torch_dtype to dtype and warns about the old name.
    new_name = Version(transformers.__version__) >= Version("4.56")
    dtype = {"dtype" if new_name else "torch_dtype": torch.float32}
    start = time.perf_counter()
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(model_path))
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, **dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **dtype)
    model.eval()
    startup = time.perf_counter() - start
    input_ids = torch.from_numpy(prompts)
    attention_mask = torch.ones_like(input_ids)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
    elapsed = time.perf_counter() - start
    output_tokens = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    result = throughput(prompts.shape[0], prompts.size, int(output_tokens), elapsed)
    result["startup_s"] = startup
    result["num_threads"] = torch.get_num_threads()
    return result


def _report(name: str, r: dict) -> None:
    print(
        f"{name}: Throughput: {r['requests_per_second']:.2f} requests/s, "
        f"{r['tokens_per_second']:.2f} total tokens/s, {r['output_tokens_per_second']:.2f} output tokens/s "
        f"(generate {r['elapsed']:.2f} s, start-up {r['startup_s']:.2f} s)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parse_args(parser, argv)
    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(ns, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    load_at_start = os.getloadavg()[0]
    try:
        engine_args = engine_args_from_namespace(ns)
        result, llm = run_jaxserve(ns, engine_args)
    except ValueError as e:
        print(f"throughput: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    model_config = llm.llm_engine.config.model_config
    print(
        f"Model {model_config.model}: {ns.num_prompts} prompts x {ns.input_len} input tokens, "
        f"{ns.output_len} output tokens each"
    )
    _report("jaxserve", result)
    report = {
        "config": {
            "model": model_config.model,
            "input_len": ns.input_len,
            "output_len": ns.output_len,
            "num_prompts": ns.num_prompts,
            "seed": ns.seed,
            "dtype": model_config.dtype,
            "max_num_seqs": llm.llm_engine.config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": llm.llm_engine.config.scheduler_config.max_num_batched_tokens,
            "enforce_eager": engine_args.enforce_eager,
            # Other processes on the machine skew both sides; this says how busy it was.
            "load_average_1m_at_start": load_at_start,
            "cpu_count": os.cpu_count(),
        },
        "jaxserve": result,
    }
    if ns.sampling_costs:
        vocab_size = int(model_config.get("vocab_size"))
        requests = [
            {"prompt_token_ids": row.tolist()}
            for row in random_prompts(ns.num_prompts, ns.input_len, vocab_size, ns.seed)
        ]
        costs = run_sampling_costs(llm, requests, ns.output_len)
        for name, r in costs.items():
            print(
                f"  {name}: {r['output_tokens_per_second']:.2f} output tokens/s ({r['ratio_to_plain']:.2f}x plain)"
            )
        report["sampling_costs"] = costs
    if ns.hf_baseline:
        vocab_size = int(model_config.get("vocab_size"))
        prompts = random_prompts(ns.num_prompts, ns.input_len, vocab_size, ns.seed)
        pad = llm.llm_engine.eos_token_id
        del llm  # free the engine's memory before the second copy of the weights loads
        pad = 0 if pad is None else pad
        baseline = run_transformers(model_config.model, prompts, ns.output_len, pad, ns.hf_num_threads)
        _report("transformers", baseline)
        ratio = result["output_tokens_per_second"] / baseline["output_tokens_per_second"]
        print(f"Output tokens/s ratio jaxserve/transformers: {ratio:.2f}")
        report["transformers"] = baseline
        report["ratio"] = ratio
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
