"""The engine loop's host overhead, on a model too small to cost the device anything:
synchronous against asynchronous scheduling, alternating in one engine.

A 2-layer, 64-wide Llama with dummy weights (written to a temporary directory, no tokenizer)
decodes greedily from 32-token prompts at batch 1, 64 and 256; every decode step (a step whose
rows are all single-token decodes) is timed from the outside by wrapping the engine's parts:

- step: one `LLMEngine.step()`, wall time (in steady state one step is dispatched and one
  collected per call, so this is the time per step either way);
- scheduler: `Scheduler.schedule`; prepare: `batch.prepare` (the step's numpy inputs);
- wait: the device->host copy of the results (`jax.device_get`), i.e. the host waiting for the device;
- host: step - wait, the host's own work per step (scheduling, preparing, dispatching, updating
  requests, building outputs);
- device: the same decode step's program replayed back to back with nothing else running;
- idle gap: step - device, the time per step the device is not running a step;
- host alone: the synchronous loop once more with the decode step's program replaced by one that
  hands back a real step's outputs at once. Everything else runs as always (scheduling, preparing,
  the transfer, updating, outputs), without XLA's computation beside it: on a machine with two
  cores the step's threads and the host's Python share them (and the caches), which inflates the
  host's figures above; an accelerator's host does not share its cores with the step.

    python benchmarks/engine_overhead.py [--batch-sizes 1 64 256] [--rounds 2] [--output-json FILE]
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
    model_dir: str,
    batch: int,
    input_len: int,
    output_len: int,
    seed: int,
    eager: bool = False,
    rounds: int = 2,
) -> dict:
    import numpy as np

    from jaxserve import LLM, SamplingParams

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
        # compiled in this process only: a measurement neither reads nor fills the start-up cache
        compilation_config={"cache_dir": ""},
    )
    engine = llm.llm_engine
    vocab = int(engine.config.model_config.get("vocab_size"))
    prompts = [
        {"prompt_token_ids": p}
        for p in np.random.default_rng(seed).integers(3, vocab, size=(batch, input_len)).tolist()
    ]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    tokens, rows = {}, {"sync": [], "async": []}
    for mode in rows:  # warm-up: every shape compiled before anything is timed
        engine.async_scheduling = mode == "async"
        llm.generate(prompts, params.clone(max_tokens=4), use_tqdm=False)
    decode_step = []
    for _ in range(rounds):
        for mode in rows:  # alternating, so that a noisy machine weighs on both alike
            engine.async_scheduling = mode == "async"
            found, tokens[mode] = _timed_run(llm, prompts, params, batch, decode_step)
            rows[mode] += found
    assert tokens["sync"] == tokens["async"], "asynchronous scheduling changed the outputs"
    device = _device_time(engine, decode_step[-1]) if decode_step else float("nan")
    result = {"batch": batch, "device_ms": 1000 * device}
    if decode_step:
        engine.async_scheduling = False
        rows["host_alone"] = _host_alone(llm, prompts, params, batch, decode_step[-1], rounds)
    for mode, found in rows.items():
        summary = {k: 1000 * statistics.median(r[k] for r in found) for k in found[0]} if found else {}
        if summary and mode != "host_alone":
            summary["idle_gap"] = max(0.0, summary["step"] - 1000 * device)
        result[mode] = {"decode_steps_measured": len(found), "ms_median": summary}
    return result


def _timed_run(llm, prompts, params, batch: int, decode_step: list) -> tuple[list[dict], list]:
    """One generate() with the engine's parts timed: the decode steps' rows and the outputs."""
    import jax

    from jaxserve.runner import batch as batch_lib

    engine = llm.llm_engine
    sizes: list[int] = []
    step = Timer(engine, "step")
    schedule = Timer(engine.scheduler, "schedule")
    prepare = Timer(batch_lib, "prepare")
    wait = Timer(jax, "device_get")
    inner_schedule = schedule.inner

    def counting_schedule(*args, **kwargs):
        out = inner_schedule(*args, **kwargs)
        decode = not out.is_empty and out.num_tokens == len(out.seqs)
        sizes.append(len(out.seqs) if decode else 0)
        if decode and len(out.seqs) == batch:
            decode_step[:] = [out]
        return out

    schedule.inner = counting_schedule
    timers = (step, schedule, prepare, wait)
    try:
        for t in timers:
            t.on = True
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        for t in timers:
            t.restore()

    def within(timer: Timer, span: tuple[float, float]) -> tuple[float, float] | None:
        found = [c for c in timer.calls if span[0] <= c[0] <= span[1]]
        return found[0] if len(found) == 1 else None

    steps = [
        (span, within(schedule, span), within(prepare, span), within(wait, span), n)
        for span, n in zip(step.calls, sizes, strict=False)
    ]
    rows = []
    for (span, sched, prep, waited, n), (_, _, _, _, next_n) in zip(steps, steps[1:]):
        if n != batch or next_n != batch or None in (sched, prep, waited):
            continue  # a decode step followed by a decode step
        rows.append(
            {
                "step": span[1] - span[0],
                "scheduler": sched[1] - sched[0],
                "prepare": prep[1] - prep[0],
                "wait": waited[1] - waited[0],
                "host": (span[1] - span[0]) - (waited[1] - waited[0]),
            }
        )
    return rows, [list(o.outputs[0].token_ids) for o in outputs]


def _host_alone(llm, prompts, params, batch: int, sched, rounds: int) -> list[dict]:
    """The synchronous loop's decode steps with the decode program replaced by a stand-in that
    returns a real run's outputs without computing anything."""
    from jaxserve.runner.step import StepVariant

    runner = llm.llm_engine.runner
    decode_bucket = runner.ready_buckets.pick(sched.num_tokens, len(sched.seqs))
    real_compile = runner._compile
    kept = []

    def compile_with_stand_in(bucket, variant=StepVariant()):
        program = real_compile(bucket, variant)
        if bucket != decode_bucket or variant != StepVariant():
            return program

        def stand_in(state, pool, processors, last, inputs):
            if not kept:  # the first call runs, the others hand back its tokens and results
                kept.append(program(state, pool, processors, last, inputs))
                return kept[0]
            return pool, processors, kept[0][2], kept[0][3]

        return stand_in

    runner._compile = compile_with_stand_in
    try:
        rows = []
        for _ in range(rounds):
            rows += _timed_run(llm, prompts, params, batch, [])[0]
        return rows
    finally:
        runner._compile = real_compile


def _device_time(engine, sched, repeats: int = 30) -> float:
    """Seconds per run of a decode step's program replayed back to back (no host work between)."""
    import jax

    from jaxserve.runner import batch as batch_lib
    from jaxserve.runner.step import StepVariant

    runner = engine.runner
    bucket = runner.ready_buckets.pick(sched.num_tokens, len(sched.seqs))
    program = runner._compile(bucket, StepVariant.for_batch(sched))
    args = (sched, *bucket, runner.page_size, runner.pages_per_seq, runner.pad_slot, runner.attention_backend)
    inputs = jax.device_put(batch_lib.PackedBatch.pack(batch_lib.prepare(*args)), runner._replicated)
    pool, last = runner.kv_pool, runner._last_tokens
    for i in range(repeats + 3):
        if i == 3:
            jax.block_until_ready(last)
            start = time.perf_counter()
        pool, _, last, _ = program(runner.state, pool, None, last, inputs)
    jax.block_until_ready(last)
    elapsed = time.perf_counter() - start
    runner.kv_pool, runner._last_tokens = pool, last
    return elapsed / repeats


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmarks/engine_overhead.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="Alternating sync/async runs per batch size.")
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
                r = measure(
                    model_dir, batch, ns.input_len, ns.output_len, ns.seed, ns.enforce_eager, ns.rounds
                )
            results.append(r)
            for mode in ("sync", "async"):
                m = r[mode]["ms_median"]
                print(
                    f"batch {batch:4d} {mode:5s}: {m['step']:.2f} ms/step, host {m['host']:.2f} (scheduler "
                    f"{m['scheduler']:.2f}, prepare {m['prepare']:.2f}), wait {m['wait']:.2f}, device "
                    f"{r['device_ms']:.2f}, idle gap {m['idle_gap']:.2f} [{r[mode]['decode_steps_measured']} steps]"
                )
            alone = r["host_alone"]["ms_median"]
            print(
                f"batch {batch:4d} host alone: {alone['step']:.2f} ms/step (scheduler {alone['scheduler']:.2f}, "
                f"prepare {alone['prepare']:.2f}) [{r['host_alone']['decode_steps_measured']} steps]"
            )
            sync, overlapped = r["sync"]["ms_median"], r["async"]["ms_median"]
            r["async_over_sync"] = {k: overlapped[k] / sync[k] if sync[k] else None for k in ("step", "host")}
            print(f"batch {batch:4d}: async/sync step time {r['async_over_sync']['step']:.2f}x")
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
