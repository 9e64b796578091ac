"""The host's per-step work without a device: Scheduler.schedule, batch.prepare and
Scheduler.update over N requests decoding, timed in a tight loop (median per step, microseconds).
No JAX runs, so the figures are the host code alone and repeat within a few percent, which the
engine-overhead benchmark (benchmarks/engine_overhead.py, the whole loop beside XLA) cannot.

    python benchmarks/host_step.py [--batch-sizes 1 64 256] [--steps 400] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler
from jaxserve.runner import batch
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler_output import ModelRunnerOutput


def measure(batch_size: int, steps: int, prompt_len: int = 32) -> dict:
    page = 16
    max_len = prompt_len + steps + 8
    pages_per_seq = -(-max_len // page)
    num_blocks = batch_size * pages_per_seq + 2
    config = SchedulerConfig(
        max_num_seqs=max(batch_size, 1),
        max_num_batched_tokens=max(2048, batch_size * prompt_len),
        max_model_len=max_len,
    )
    sched = Scheduler(config, CacheConfig(block_size=page), num_blocks)
    for i in range(batch_size):
        prompt = [3 + (i * 7919 + j * 31) % 1000 for j in range(prompt_len)]
        params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0.8, top_p=0.9)
        sched.add_request(Request(f"r{i}", prompt, params, seed=i, eos_token_id=1, max_tokens=steps + 4))
    seq_bucket = 1 << max(batch_size - 1, 0).bit_length()
    times = {"schedule": [], "prepare": [], "update": []}
    for step in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        token_bucket = max(out.num_tokens, seq_bucket)
        batch.prepare(out, token_bucket, seq_bucket, page, pages_per_seq, num_blocks * page, "reference")
        t2 = time.perf_counter()
        ids = tuple(s.request_id for s in out.seqs if s.sampling is not None)
        result = ModelRunnerOutput(ids, np.full(len(ids), 7, np.int32), np.full(len(ids), -0.5, np.float32))
        t3 = time.perf_counter()
        sched.update(out, result)
        t4 = time.perf_counter()
        if step >= 2:  # past the prefill
            times["schedule"].append(t1 - t0)
            times["prepare"].append(t2 - t1)
            times["update"].append(t4 - t3)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    med["total"] = sum(med.values())
    return med


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    results = {}
    for b in ns.batch_sizes:
        results[b] = measure(b, ns.steps)
        print(f"batch {b:4d}: " + ", ".join(f"{k} {v:.1f} us" for k, v in results[b].items()), flush=True)
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            json.dump({"config": vars(ns), "us_median_per_step": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
