"""Where one batch-1 decode step's time goes: XLA's own profile of the compiled step, by part.

The default model (or --model) decodes one 128-token prompt greedily; its decode step's program is
then replayed back to back (device time per step, no host work between) and profiled with
jax.profiler. Each operation the profile names is put in a part of the model by the source line
and operation name XLA keeps in its metadata: the layers' projections (XLA's dequantize loops and
dots, or the native kernel), attention, the LM head, sampling, and the rest. A part's time is the
sum of its operations' time on every thread, per step, so the parts add up to more than the step
when XLA runs operations on both cores. The host's side of a step (scheduling, outputs) is
benchmarks/engine_overhead.py's; the server's, benchmarks/llama_cpp_compare.py's TPOT against
this device time.

    python benchmarks/decode_profile.py [--quantization gguf|none|int8] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence

# part -> (patterns over "op_name source_file"), first match wins; unmatched: "other"
PARTS = (
    ("projections (native kernel)", (r"jaxserve_q4_matmul",)),
    ("attention (native kernel)", (r"jaxserve_ragged_paged_attention",)),
    ("attention", (r"ragged_paged_attention|reference\.py|attention\.py",)),
    # the layers' dots carry no metadata; their operands' dequantize loops, casts and slice copies do
    (
        "projections (XLA)",
        (r"^dot\.\d+ $|while/body/closed_call/(add|mul|convert_element_type|dynamic_slice)$",),
    ),
    ("LM head", (r"jaxserve_q8_head|tied_head|_chunked_head|lm_head|dot_general$",)),
    ("sampling", (r"sampler\.py|log_softmax|argmax|_uniform",)),
    ("norms, rope, residuals", (r"norm\.py|rotary\.py|llama\.py",)),
)
# the runtime's own spans, and loops (spans around the operations of their bodies, counted themselves)
SKIPPED = ("ThunkExecutor", "end:", "Threadpool", "while")


def _part(name: str, meta: str) -> str:
    text = f"{name} {meta}"
    for part, patterns in PARTS:
        if any(re.search(p, text) for p in patterns):
            return part
    return "other"


def _metadata(hlo: str) -> dict[str, str]:
    """Instruction name -> its op_name and source file, from the compiled HLO text."""
    found = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", hlo, re.M):
        name, rest = m.group(1), m.group(2)
        op = re.search(r'op_name="([^"]*)"', rest)
        src = re.search(r'source_file="([^"]*)"', rest)
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        found[name] = " ".join(
            filter(
                None, (op and op.group(1), src and os.path.basename(src.group(1)), target and target.group(1))
            )
        )
    return found


def profile(model: str | None, quantization: str | None, steps: int) -> dict:
    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.step import StepVariant

    kwargs = {"quantization": quantization} if quantization else {}
    llm = LLM(model=model, enforce_eager=True, compilation_config={"cache_dir": ""}, **kwargs)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    decodes = []
    schedule = engine.scheduler.schedule

    def keep_decodes(*args, **kw):
        out = schedule(*args, **kw)
        if not out.is_empty and out.num_tokens == len(out.seqs):
            decodes.append(out)
        return out

    engine.scheduler.schedule = keep_decodes
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate({"prompt_token_ids": list(range(1000, 1128))}, params, use_tqdm=False)
    engine.scheduler.schedule = schedule
    sched = decodes[-1]
    bucket = runner.ready_buckets.pick(sched.num_tokens, len(sched.seqs))
    program = runner._compile(bucket, StepVariant.for_batch(sched))
    from jaxserve.runner import batch as batch_lib

    inputs = jax.device_put(batch_lib.PackedBatch.pack(runner.prepare(sched, bucket)), runner._replicated)
    state = {"pool": runner.kv_pool, "last": runner._last_tokens}

    def run(n: int) -> None:
        for _ in range(n):
            state["pool"], _, state["last"], _ = program(
                runner.state, state["pool"], None, state["last"], inputs
            )
        jax.block_until_ready(state["last"])

    run(5)
    start = time.perf_counter()
    run(steps)
    device_ms = 1000 * (time.perf_counter() - start) / steps
    meta = _metadata(program.as_text())
    trace_dir = tempfile.mkdtemp(prefix="jaxserve-profile-")
    with jax.profiler.trace(trace_dir):
        run(steps)
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    parts, ops = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if "XLA" not in line.name:  # XLA's worker threads; not the Python thread
                continue
            for event in line.events:
                if event.name.startswith(SKIPPED):
                    continue
                ms = event.duration_ns / 1e6 / steps
                parts[_part(event.name, meta.get(event.name, ""))] += ms
                ops[event.name] += ms
    runner.kv_pool, runner._last_tokens = state["pool"], state["last"]
    return {
        "quantization": quantization or "as stored",
        "native_kernels": getattr(runner, "native_kernels", False),
        "device_ms_per_step": device_ms,
        "parts_ms_per_step": dict(parts.most_common()),
        "top_operations_ms_per_step": {k: [v, meta.get(k, "")] for k, v in ops.most_common(15)},
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmarks/decode_profile.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=None, help="Default: the default model (GGUF).")
    parser.add_argument("--quantization", nargs="+", default=[None], help="Each run's -q (none, int8, ...).")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-json", default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    results = []
    for quantization in ns.quantization:
        with contextlib.redirect_stderr(open(os.devnull, "w")):
            r = profile(ns.model, None if quantization in (None, "gguf") else quantization, ns.steps)
        results.append(r)
        print(
            f"-q {r['quantization']}: {r['device_ms_per_step']:.2f} ms per decode step (native kernels: {r['native_kernels']})"
        )
        for part, ms in r["parts_ms_per_step"].items():
            print(f"    {ms:7.2f} ms  {part}")
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            json.dump({"config": {**vars(ns), "cpu_count": os.cpu_count()}, "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
