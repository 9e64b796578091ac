"""What the prefix cache's page hash costs the host: sha256 (the default) against builtin.

Why it exists: every admitted prompt is hashed page by page (the cache lookup), and every page a
request fills is hashed once more when it is registered; sha256 replaced Python's 64-bit hash so
that no crafted prompt can collide with another's pages. This measures both algorithms on the
real BlockManager, alternating rounds in one process:

  lookup    get_computed_blocks on a prompt whose pages are all cached (hash + verify per page)
  register  cache_full_blocks of a fresh request's full prompt
  step      the per-step share at a decode batch of --seqs sequences: one new page every
            block_size steps per sequence

    python benchmarks/prefix_hash.py --prompt-len 2048 --seqs 256

Writes benchmarks/results/prefix_hash_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

from jaxserve.engine.block_manager import BlockManager

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def measure(algo: str, prompt: list[int], block_size: int, repeats: int) -> dict[str, float]:
    pages = len(prompt) // block_size
    bm = BlockManager(pages * 2 + 2, block_size, enable_prefix_caching=True, hash_algo=algo)
    assert bm.allocate("warm", len(prompt))
    bm.cache_full_blocks("warm", prompt, len(prompt))
    lookups, registers = [], []
    for i in range(repeats):
        start = time.perf_counter()
        blocks, hit = bm.get_computed_blocks(prompt + [0])
        lookups.append(time.perf_counter() - start)
        assert hit == len(prompt)
        other = [t + 1 + i for t in prompt]  # a prompt nothing is cached for
        assert bm.allocate("r", len(other))
        start = time.perf_counter()
        bm.cache_full_blocks("r", other, len(other))
        registers.append(time.perf_counter() - start)
        bm.free("r")
    return {
        "lookup_us_per_page": statistics.median(lookups) / pages * 1e6,
        "register_us_per_page": statistics.median(registers) / pages * 1e6,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seqs", type=int, default=256, help="Decode batch for the per-step figure.")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="Alternating rounds of both algorithms.")
    args = p.parse_args()
    prompt = np.random.default_rng(0).integers(0, 49152, size=args.prompt_len).tolist()
    rounds: dict[str, list[dict]] = {"builtin": [], "sha256": []}
    for _ in range(args.rounds):
        for algo in rounds:
            rounds[algo].append(measure(algo, prompt, args.block_size, args.repeats))
    result = {
        "config": vars(args),
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
    }
    for algo, runs in rounds.items():
        med = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
        # one page registered per sequence every block_size decode steps
        med["step_us_at_seqs"] = round(med["register_us_per_page"] * args.seqs / args.block_size, 1)
        result[algo] = med
    result["sha256_over_builtin"] = {
        k: round(result["sha256"][k] / result["builtin"][k], 2) for k in result["builtin"]
    }
    os.makedirs(RESULTS, exist_ok=True)
    out = os.path.join(RESULTS, "prefix_hash_cpu.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps({k: result[k] for k in ("builtin", "sha256", "sha256_over_builtin")}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
