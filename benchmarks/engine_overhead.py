"""The engine loop's host overhead, on a model too small to cost the device anything.

A 2-layer, 64-wide Llama with dummy weights (written to a temporary directory, no tokenizer)
decodes greedily from 32-token prompts at batch 1, 64 and 256; every decode step (a step whose
rows are all single-token decodes) is timed from the outside by wrapping the engine's parts:

- step: one `LLMEngine.step()`, wall time;
- scheduler: `Scheduler.schedule`; prepare: `batch.prepare` (the step's numpy inputs);
- wait: the device->host copy of the results (`jax.device_get`), i.e. the host waiting for the device;
- host: step - wait, the host's own work per step (scheduling, preparing, dispatching, updating
  requests, building outputs);
- idle gap: from the end of one step's wait (its results are in) to the start of the next step's
  wait, less that step's own dispatch: what the device waits for the host between two steps.

    python benchmarks/engine_overhead.py [--batch-sizes 1 64 256] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


class Timer:
    """Wraps `owner.name` and records (start, end) of every call while `on`."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.inner = owner, name, getattr(owner, name)
        self.calls: list[tuple[float, float]] = []
        self.on = False
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            if self.on:
                self.calls.append((start, time.perf_counter()))

    def restore(self) -> None:
        setattr(self.owner, self.name, self.inner)


def measure(
    model_dir: str, batch: int, input_len: int, output_len: int, seed: int, eager: bool = False
) -> dict:
    import jax
    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.runner import batch as batch_lib

    llm = LLM(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch),
        max_model_len=input_len + output_len + 8,
        num_gpu_blocks_override=batch * ((input_len + output_len) // 16 + 2) + 1,
        use_tqdm_on_load=False,
        enforce_eager=eager,
    )
    engine = llm.llm_engine
    vocab = int(engine.config.model_config.get("vocab_size"))
    prompts = np.random.default_rng(seed).integers(3, vocab, size=(batch, input_len)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params.clone(max_tokens=4), use_tqdm=False)

    sizes: list[int] = []
    step = Timer(engine, "step")
    schedule = Timer(engine.scheduler, "schedule")
    prepare = Timer(batch_lib, "prepare")
    wait = Timer(jax, "device_get")
    inner_schedule = schedule.inner

    def counting_schedule(*args, **kwargs):
        out = inner_schedule(*args, **kwargs)
        sizes.append(-1 if out.is_empty else (out.num_tokens if out.num_tokens == len(out.seqs) else 0))
        return out

    schedule.inner = counting_schedule
    timers = (step, schedule, prepare, wait)
    try:
        for t in timers:
            t.on = True
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        for t in timers:
            t.restore()

    def within(timer: Timer, span: tuple[float, float]) -> tuple[float, float] | None:
        found = [c for c in timer.calls if span[0] <= c[0] <= span[1]]
        return found[0] if len(found) == 1 else None

    steps = [
        (span, within(schedule, span), within(prepare, span), within(wait, span), n)
        for span, n in zip(step.calls, sizes, strict=True)
    ]
    rows = []
    for (span, sched, prep, waited, n), (_, _, next_prep, next_wait, next_n) in zip(steps, steps[1:]):
        if n != batch or next_n != batch or None in (sched, prep, waited, next_prep, next_wait):
            continue  # a decode step followed by a decode step
        dispatch = next_wait[0] - next_prep[1]  # the next step's transfer and launch, before it waits
        rows.append(
            {
                "step": span[1] - span[0],
                "scheduler": sched[1] - sched[0],
                "prepare": prep[1] - prep[0],
                "wait": waited[1] - waited[0],
                "host": (span[1] - span[0]) - (waited[1] - waited[0]),
                "idle_gap": max(0.0, (next_wait[0] - waited[1]) - dispatch),
            }
        )
    summary = {k: 1000 * statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
    return {"batch": batch, "decode_steps_measured": len(rows), "elapsed_s": elapsed, "ms_median": summary}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmarks/engine_overhead.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--enforce-eager", action="store_true", help="Compile only the shapes used (quick runs)."
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as fh:
            json.dump({**TINY, "vocab_size": ns.vocab_size}, fh)
        for batch in ns.batch_sizes:
            with contextlib.redirect_stderr(open(os.devnull, "w")):
                r = measure(model_dir, batch, ns.input_len, ns.output_len, ns.seed, ns.enforce_eager)
            results.append(r)
            m = r["ms_median"]
            print(
                f"batch {batch:4d}: {m['step']:.2f} ms/step, host {m['host']:.2f} (scheduler {m['scheduler']:.2f}, "
                f"prepare {m['prepare']:.2f}), wait {m['wait']:.2f}, idle gap {m['idle_gap']:.2f} "
                f"[{r['decode_steps_measured']} decode steps]"
            )
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            json.dump(
                {"config": {**vars(ns), "model": TINY, "cpu_count": os.cpu_count()}, "results": results},
                fh,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
