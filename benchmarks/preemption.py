"""Preemption by swap against preemption by recompute: the same long-prompt workload on a KV pool
too small for it, once per mode, rounds alternating in one process.

N requests of P random prompt tokens each generate T tokens (greedy, EOS ignored) on the default
model (or --model) with a pool of pages for half of the prompts and half of those requests'
outputs, so running requests are preempted as they grow. Recompute prefills a preempted request's prompt and outputs
again when it returns (prefix caching off, so nothing is found cached); swap copies its pages to
host memory and back. Reported per mode: wall time per run (median of the rounds), output tokens/s,
preemptions and swaps per run, bytes swapped out, and whether every run gave the tokens of the
first recompute run; and the ratio swap / recompute.

    python benchmarks/preemption.py [--model M] [--requests 8] [--prompt-len 1024] [--tokens 64]
        [--rounds 2] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

DEFAULT_MODEL = "~/.cache/jaxserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE = 16


def run(ns: argparse.Namespace) -> dict:
    import numpy as np

    from jaxserve import LLM, SamplingParams

    # pages for half of the prompts and half of those requests' growth: they are preempted as they grow
    half = max(1, ns.requests // 2)
    pool = 1 + half * (-(-ns.prompt_len // BLOCK_SIZE)) + half * -(-ns.tokens // BLOCK_SIZE) // 2
    common = dict(
        max_model_len=ns.prompt_len + ns.tokens, block_size=BLOCK_SIZE, enable_prefix_caching=False,
        num_gpu_blocks_override=pool, max_num_seqs=ns.requests,
        use_tqdm_on_load=False, compilation_config={"cache_dir": ""}, enforce_eager=ns.enforce_eager,
    )  # fmt: skip
    engines = {
        "recompute": LLM(os.path.expanduser(ns.model), preemption_mode="recompute", **common),
        "swap": LLM(os.path.expanduser(ns.model), preemption_mode="swap", swap_space=ns.swap_space, **common),
    }
    vocab = engines["swap"].llm_engine.runner.args.vocab_size
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(3, vocab, ns.prompt_len).tolist()} for _ in range(ns.requests)
    ]
    if ns.swap_min_tokens is not None:
        engines["swap"].llm_engine.scheduler.swap.min_tokens = ns.swap_min_tokens
    params = SamplingParams(max_tokens=ns.tokens, temperature=0.0, ignore_eos=True)
    seconds = {name: [] for name in engines}
    counts = {name: [] for name in engines}
    reference, same = None, {name: True for name in engines}
    for _ in range(ns.rounds):
        for name, llm in engines.items():
            scheduler = llm.llm_engine.scheduler
            before = (scheduler.num_preemptions, scheduler.swap.num_swap_outs if scheduler.swap else 0)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            reference = reference or tokens
            same[name] &= tokens == reference
            after = (scheduler.num_preemptions, scheduler.swap.num_swap_outs if scheduler.swap else 0)
            counts[name].append((after[0] - before[0], after[1] - before[1]))
    report = {
        "model": ns.model, "requests": ns.requests, "prompt_len": ns.prompt_len, "tokens": ns.tokens,
        "pool_blocks": common["num_gpu_blocks_override"], "block_size": BLOCK_SIZE, "rounds": ns.rounds,
        "modes": {},
    }  # fmt: skip
    for name, llm in engines.items():
        wall = statistics.median(seconds[name])
        swap = llm.llm_engine.scheduler.swap
        report["modes"][name] = {
            "seconds": seconds[name],
            "median_s": wall,
            "output_tok_per_s": ns.requests * ns.tokens / wall,
            "preemptions_per_run": [c[0] for c in counts[name]],
            "swap_outs_per_run": [c[1] for c in counts[name]],
            "swap_out_bytes": swap.bytes_out if swap else 0,
            "same_tokens": same[name],
        }
    report["swap_over_recompute"] = (
        report["modes"]["recompute"]["median_s"] / report["modes"]["swap"]["median_s"]
    )
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--swap-space", type=float, default=4.0, help="GiB")
    parser.add_argument(
        "--swap-min-tokens", type=int, default=None, help="(tiny models: swap shorter contexts)"
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    report = run(ns)
    for name, r in report["modes"].items():
        print(
            f"{name:10s} {r['median_s']:7.2f} s  {r['output_tok_per_s']:7.1f} output tok/s  preemptions "
            f"{r['preemptions_per_run']} swaps {r['swap_outs_per_run']}  {'the same tokens' if r['same_tokens'] else 'OTHER TOKENS'}"
        )
    print(f"swap / recompute: {report['swap_over_recompute']:.2f}x")
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0 if all(r["same_tokens"] for r in report["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
