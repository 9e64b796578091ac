"""`jaxserve tpu-compile-check`: will this model and these flags serve on that TPU slice?

Compiles every step program the server would compile there (aot/compile_check.py), prints one
line per program and a summary with the memory and a roofline projection (aot/roofline.py), and
exits 0 only when every program compiled and fits; else one line per failure and exit 1.
"""

from __future__ import annotations

import json
import sys
import time

from jaxserve.aot.chips import Target
from jaxserve.aot.compile_check import Program, Report, check
from jaxserve.aot.roofline import Workload, project
from jaxserve.args import EngineArgs

GIB = 2**30


def parse_workload(text: str) -> Workload:
    """'1800:128' -> 1800 prompt tokens, 128 generated."""
    try:
        prompt, output = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(
            f"--workload must be INPUT:OUTPUT token counts, e.g. 1800:128; got {text!r}"
        ) from None
    if prompt < 1 or output < 1:
        raise ValueError(f"--workload token counts must be positive; got {text!r}")
    return Workload(prompt, output)


def run(engine_args: EngineArgs, topology: str, scope: str, workload: Workload, json_path: str | None) -> int:
    import jax

    # Nothing runs on a device: the compiler is libtpu's, the host is this one's CPU.
    jax.config.update("jax_platforms", "cpu")
    target = Target.parse(topology)
    start = time.perf_counter()
    report = check(engine_args, target, scope, progress=_print_program)
    elapsed = time.perf_counter() - start
    projected = project(report, target.chip, workload) if not report.refused else None
    _print_summary(report, projected, workload, elapsed)
    if json_path:
        record = {**report.as_dict(), "seconds": elapsed, "workload": vars(workload), "projected": projected}
        with open(json_path, "w") as fh:
            json.dump(record, fh, indent=1)
    failures = report.failures()
    for line in failures:
        print(line, file=sys.stderr)
    return 1 if failures else 0


def _print_program(p: Program) -> None:
    if p.error:
        print(f"  {p.bucket} {p.variant} {p.part}: FAILED {p.error}", file=sys.stderr, flush=True)
        return
    print(
        f"  {p.bucket} {p.variant} {p.part}: compiled in {p.seconds:.1f} s, peak {p.peak_bytes / GIB:.2f} GiB "
        f"(temp {p.temp_bytes / 2**20:.0f} MiB), {p.kernels} Pallas kernel(s)",
        file=sys.stderr,
        flush=True,
    )


def _print_summary(report: Report, projected: dict | None, workload: Workload, elapsed: float) -> None:
    head = f"{report.model} on {report.target}, {report.layout}"
    if report.refused:
        print(f"{head}: refused: {report.refused}")
        return
    compiled = sum(p.error is None for p in report.programs)
    print(
        f"{head}: {report.dtype} weights{' (' + report.quantization + ')' if report.quantization else ''}, "
        f"{report.kv_cache_dtype} KV, attention {report.attention_backend}"
        f"{f', {report.max_loras} LoRA slots' if report.max_loras else ''}; "
        f"{compiled}/{len(report.programs)} programs compiled in {elapsed:.0f} s"
    )
    print(
        f"  memory per chip: weights {report.weight_bytes / GIB:.2f} GiB + KV pool {report.kv_pool_bytes / GIB:.2f} GiB "
        f"({report.num_blocks} blocks, {report.kv_tokens:,} tokens)"
        + (
            f" + draft model {report.draft_weight_bytes / GIB:.2f} GiB + its pool {report.draft_kv_pool_bytes / GIB:.2f} GiB"
            if report.draft_weight_bytes
            else ""
        )
        + " at --gpu-memory-utilization "
        f"{report.gpu_memory_utilization}; XLA's peak {report.peak_bytes / GIB:.2f} GiB of {report.hbm_bytes / GIB:.2f} GiB"
    )
    if projected:
        print(
            f"  projected (roofline, an upper bound) for {workload.input_len} in / {workload.output_len} out: "
            f"{projected['concurrency']} requests at once, decode step {projected['decode_step_ms']:.2f} ms "
            f"({projected['decode_bound']}-bound), {projected['output_tok_s']:,.0f} output tok/s, "
            f"{projected['req_s']:.2f} req/s"
        )
    else:
        print(
            f"  no projection for {workload.input_len} in / {workload.output_len} out: longer than max_model_len, "
            "or its decode bucket was not compiled (--programs default compiles every bucket)"
        )
