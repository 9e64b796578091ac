"""Pipeline parallel on fake CPU devices: throughput of pp=2 against pp=1.

Every configuration serves the default model (--quantization none: float32 stacks) to the same
batch of prompts, greedily, in one process whose CPU is split into fake devices: no
configuration can be faster than one device, since the devices share the same cores. Reported:
decode and prefill tokens/s of each configuration and their ratio to pp=1 on one device (tp=3: the
other way to split the model over devices; SmolLM2-135M has 9 heads, 3 KV heads), and whether
each gave the same tokens. With one batch in the pipeline the stages take turns, so pp=2 does the
work of pp=1 plus a permute of the activations and a sum of the output per step; and a device that
is not the mesh's only one runs without the native CPU kernels (they serve one-device meshes).

    python benchmarks/pipeline_parallel.py [--configs 1x1 2x1 1x3] [--batch 8] [--prompt-len 128]
        [--max-tokens 64] [--rounds 2] [--output-json FILE]

A configuration is PPxTP. The device count is fixed when JAX starts: this script sets it (8).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()


def _engine(model: str | None, pp: int, tp: int):
    from jaxserve import LLM

    return LLM(
        model, quantization="none", pipeline_parallel_size=pp, tensor_parallel_size=tp, max_num_seqs=16
    )


def _timed(llm, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def measure(
    model: str | None, configs: Sequence[str], batch: int, prompt_len: int, max_tokens: int, rounds: int
) -> dict:
    """Per configuration: prefill tokens/s (one output token) and decode tokens/s (the rest of
    max_tokens, the prefill's time taken off), medians over rounds that alternate configurations."""
    import random

    from jaxserve import SamplingParams

    engines = {c: _engine(model, *map(int, c.split("x"))) for c in configs}
    vocab = min(40000, engines[configs[0]].llm_engine.runner.args.vocab_size)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]} for _ in range(batch)
    ]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = {}
    for c, llm in engines.items():  # compile every program on the way; the same tokens everywhere
        llm.reset_prefix_cache()
        tokens[c] = [o.outputs[0].token_ids for o in llm.generate(prompts, many, use_tqdm=False)]
    prefill, decode = collections.defaultdict(list), collections.defaultdict(list)
    for _ in range(rounds):
        for c, llm in engines.items():
            llm.reset_prefix_cache()
            seconds, _ = _timed(llm, prompts, one)
            prefill[c].append(batch * prompt_len / seconds)
            llm.reset_prefix_cache()
            total, n = _timed(llm, prompts, many)
            decode[c].append((n - batch) / max(total - seconds, 1e-9))
    base = configs[0]
    rows = {}
    for c in configs:
        p, d = statistics.median(prefill[c]), statistics.median(decode[c])
        rows[c] = {
            "prefill_tok_s": p,
            "decode_tok_s": d,
            "prefill_ratio": p / statistics.median(prefill[base]),
            "decode_ratio": d / statistics.median(decode[base]),
            "same_tokens_as_" + base: tokens[c] == tokens[base],
        }
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmarks/pipeline_parallel.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=None, help="Default: the default model.")
    parser.add_argument(
        "--configs", nargs="+", default=["1x1", "2x1", "1x3"], help="PPxTP; the first is the base."
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    rows = measure(ns.model, ns.configs, ns.batch, ns.prompt_len, ns.max_tokens, ns.rounds)
    for c, r in rows.items():
        print(json.dumps({"config": c, **r}))
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            report = {
                "config": vars(ns),
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "results": rows,
            }
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
