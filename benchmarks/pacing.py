"""Pacing of asynchronous scheduling under staggered arrivals, in one process.

The default model behind AsyncLLMEngine (the server's engine loop, without HTTP). C clients
each send R requests one after another (64 random prompt tokens, 20-59 output tokens, greedy, EOS
ignored); the clients start at random moments within the first second, so requests arrive while
steps run. Three ways in turn, with the same seeds each round: synchronous scheduling, asynchronous
scheduling paced (the next step planned shortly before the step in flight ends, as the server
does), and asynchronous scheduling planning a whole step ahead (the pacing turned off). Per run:
output tok/s, mean time to first token, how often the loop waited and for how long, and the
pacer's measured step lengths per size class (ms).

    python benchmarks/pacing.py [--clients 8] [--requests 3] [--rounds 4] [--model GGUF]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence

DEFAULT_MODEL = "~/.cache/jaxserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"


async def _client(engine, name: str, n: int, results: list, rng) -> None:
    from jaxserve import SamplingParams

    await asyncio.sleep(rng.uniform(0, 1.0))
    for k in range(n):
        ids = rng.integers(3, min(20000, engine.engine.config.model_config.get("vocab_size")), 64).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(20, 60)), ignore_eos=True, temperature=0)
        start, first, count = time.perf_counter(), None, 0
        async for out in engine.generate({"prompt_token_ids": ids}, params, f"{name}-{k}-{time.time()}"):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            count = len(out.outputs[0].token_ids)
        results.append((first, count))


async def _run(engine, mode: str, seed: int, clients: int, requests: int) -> dict:
    import numpy as np

    from jaxserve.engine.llm_engine import LLMEngine

    core = engine.engine
    core.async_scheduling = mode != "sync"
    real = LLMEngine.seconds_until_next_step
    waits: list[float] = []

    def paced(self) -> float:
        waits.append(real(self))
        return waits[-1]

    LLMEngine.seconds_until_next_step = paced if mode == "paced" else (lambda self: 0.0)
    results: list = []
    start = time.perf_counter()
    try:
        await asyncio.gather(
            *(
                _client(engine, str(i), requests, results, np.random.default_rng(seed * 100 + i))
                for i in range(clients)
            )
        )
    finally:
        LLMEngine.seconds_until_next_step = real
    elapsed = time.perf_counter() - start
    waited = [w for w in waits if w > 0]
    return {
        "mode": mode,
        "output_tok_s": sum(n for _, n in results) / elapsed,
        "mean_ttft_ms": 1000 * statistics.mean(f for f, _ in results),
        "waits": len(waited),
        "median_wait_ms": 1000 * statistics.median(waited) if waited else 0.0,
        "step_ms_by_size": {
            k: [round(1000 * x, 1) for x in v] for k, v in sorted(core.pacer._durations.items())
        },
    }


async def _main(ns) -> list[dict]:
    from jaxserve.args import EngineArgs
    from jaxserve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=os.path.expanduser(ns.model)))
    engine.start()
    rows = []
    try:
        await _run(engine, "sync", 99, ns.clients, ns.requests)  # warm-up: every shape compiled
        for r in range(ns.rounds):
            for mode in ("sync", "paced", "unpaced"):
                row = {"round": r, **await _run(engine, mode, r, ns.clients, ns.requests)}
                rows.append(row)
                print(
                    f"round {r} {mode:8s} tok/s {row['output_tok_s']:6.1f} TTFT {row['mean_ttft_ms']:6.0f} ms  "
                    f"waits {row['waits']} median {row['median_wait_ms']:.1f} ms  step ms {row['step_ms_by_size']}",
                    flush=True,
                )
    finally:
        engine.shutdown()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/pacing.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=3, help="Requests per client, one after another.")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    rows = asyncio.run(_main(ns))
    if ns.output_json:
        import json

        with open(ns.output_json, "w") as fh:
            json.dump({"config": vars(ns), "cpu_count": os.cpu_count(), "runs": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
