"""How fast XLA runs a tied LM head whose embedding table is kept in Q8_0 groups.

logits [rows, vocab] = x [rows, hidden] @ table.T, the table [vocab, hidden] (the default model's
shape by default) stored as:

- f32: float32, the baseline (what a dequantized GGUF serves);
- q8-whole: int8 values with a scale per 32 inputs, the whole table dequantized inside the
  product (XLA fuses it into a matrix-vector product for few rows; for more, XLA:CPU writes a
  float32 copy of the table first);
- q8-chunked: the same, HEAD_CHUNK_ROWS vocabulary rows at a time (lax.map), each float32 chunk
  small enough to stay in cache;
- q8-kernel: the native CPU kernel (pallas_kernels/quantized_matmul q8_head): the int8 table read
  once for all rows, integer products per group (where the native kernels build);
- q8-served: layers/linear.py's tied_head, which picks one of these by the number of rows.

Every layout gives f32's logits on the dequantized table (checked before timing). Rounds
alternate the layouts; the median per layout and its ratio to f32 are reported.

    python benchmarks/quantized_head.py [--shape 49152 576] [--rows 1 2 4 8 16 32 64 128 256]
        [--rounds 5] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence


def run(ns) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.layers import linear
    from pallas_kernels import native
    from pallas_kernels.quantized_matmul import q8_head

    vocab, hidden = ns.shape
    rng = np.random.default_rng(0)
    groups = (rng.standard_normal((vocab, hidden // linear.GROUP, linear.GROUP)) * 0.05).astype(np.float32)
    scale = np.abs(groups).max(-1) / 127
    values = np.rint(groups / scale[..., None]).astype(np.int8)
    table = (values * scale[..., None]).reshape(vocab, hidden).astype(np.float32)
    q8 = (jnp.asarray(values.reshape(vocab, hidden)), jnp.asarray(scale.astype(np.float32)))

    def whole(x, values, scale):
        return x @ linear._dequantize_rows(values, scale).T

    layouts = {
        "f32": (jax.jit(lambda x, t: linear.tied_head(x, t, None)), (jnp.asarray(table),)),
        "q8-whole": (jax.jit(whole), q8),
        "q8-chunked": (jax.jit(linear._chunked_head), q8),
        "q8-served": (jax.jit(linear.tied_head), q8),
    }
    if native.load():
        layouts["q8-kernel"] = (jax.jit(q8_head), q8)
    report: dict = {
        "shape": [vocab, hidden],
        "head_whole_max_rows": linear.HEAD_WHOLE_MAX_ROWS,
        "head_chunk_rows": linear.HEAD_CHUNK_ROWS,
        "head_kernel_max_rows": linear.HEAD_KERNEL_MAX_ROWS,
        "bytes": {name: sum(p.nbytes for p in params) for name, (_, params) in layouts.items()},
        "rows": {},
    }
    for rows in ns.rows:
        x = jnp.asarray(rng.standard_normal((rows, hidden)).astype(np.float32))
        want = np.asarray(x) @ table.T
        for name, (f, params) in layouts.items():  # the same logits, compiled before timing
            # (the kernel multiplies x as int16 per group of 32: errors ~1e-5 of the logits' scale)
            atol = 1e-4 * max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(np.asarray(f(x, *params)), want, rtol=1e-4, atol=atol, err_msg=name)
        times: dict[str, list[float]] = {n: [] for n in layouts}
        for _ in range(ns.rounds):
            for name, (f, params) in layouts.items():
                start = time.perf_counter()
                for _ in range(ns.calls):
                    f(x, *params).block_until_ready()
                times[name].append((time.perf_counter() - start) / ns.calls * 1e3)
        report["rows"][str(rows)] = {
            n: {
                "ms": statistics.median(t),
                "ratio_to_f32": statistics.median(a / b for a, b in zip(t, times["f32"])),
            }
            for n, t in times.items()
        }
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/quantized_head.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--shape", type=int, nargs=2, default=[49152, 576], metavar=("VOCAB", "HIDDEN"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5, help="Calls timed together in each round.")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    report = run(ns)
    for rows, layouts in report["rows"].items():
        for name, r in layouts.items():
            print(
                f"{rows:>4} rows {name:11s} {r['ms']:8.2f} ms  {r['ratio_to_f32']:5.2f}x f32's time",
                flush=True,
            )
    if ns.output_json:
        import json

        with open(ns.output_json, "w") as fh:
            json.dump({"config": vars(ns), "cpu_count": os.cpu_count(), **report}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
