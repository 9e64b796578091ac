"""How fast XLA runs a decoder's projections for each way of storing quantized weights.

A stack of L layers (one lax.scan, as the models run them), each x -> x + sum(x @ W) with W of
[in, out] (the default model's MLP shape by default), for batch sizes B. W is stored as:

- f32: float32, the baseline;
- int8: int8 with one scale per output channel (what --quantization int8 serves);
- fp8: float8 e4m3 with one scale per output channel (--quantization fp8);
- u4-groups: 4-bit values as jnp.uint4, a scale and a min per 32 inputs (GGUF Q4_1's groups);
- u8-groups: the same 4-bit values one per uint8;
- packed-concat: two 4-bit values per byte, column j with column j + out/2, unpacked by
  concatenating both nibbles, then one dot;
- packed-2dots: the same bytes, each nibble a half of the columns in its own dot.

Every layout computes the same product as f32 on its dequantized weights (checked before timing).
Rounds alternate the layouts; the median per layout and its ratio to f32 are reported, with the
bytes each layout's arrays take on the device per weight.

    python benchmarks/quantized_matmul.py [--layers 30] [--shape 576 1536] [--batches 1 32]
        [--rounds 5] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

GROUP = 32


def _layouts(w):
    """Each layout's (per-layer function, stacked weights), all computing x @ (the layout's
    dequantized W); and the dequantized W of each quantized layout."""
    import jax.numpy as jnp
    import numpy as np

    layers, d_in, d_out = w.shape
    amax = np.abs(w).max(axis=1)
    s8 = amax / 127
    q8 = np.clip(np.rint(w / s8[:, None]), -127, 127).astype(np.int8)
    s_fp8 = amax / 448
    q_fp8 = (w / s_fp8[:, None]).astype(jnp.float8_e4m3fn)
    groups = w.reshape(layers, d_in // GROUP, GROUP, d_out)
    lo, hi = groups.min(axis=2), groups.max(axis=2)
    scale = np.where(hi > lo, (hi - lo) / 15, 1.0).astype(np.float32)
    q4 = np.clip(np.rint((groups - lo[:, :, None]) / scale[:, :, None]), 0, 15).astype(np.uint8)
    w4 = (q4 * scale[:, :, None] + lo[:, :, None]).reshape(w.shape)  # what the 4-bit layouts hold
    q4 = q4.reshape(w.shape)
    half = d_out // 2
    packed = q4[:, :, :half] | (q4[:, :, half:] << 4)

    def affine(q, s, m):  # 4-bit values [in, n] with group scales and mins [in / 32, n] -> float
        n = q.shape[-1]
        return (q.astype(jnp.float32).reshape(d_in // GROUP, GROUP, n) * s[:, None] + m[:, None]).reshape(
            d_in, n
        )

    def f32(x, p):
        return x @ p[0]

    def per_channel(x, p):
        return (x @ p[0].astype(x.dtype)) * p[1]

    def groups_(x, p):
        return x @ affine(*p)

    def packed_concat(x, p):
        v, s, m = p
        return x @ affine(jnp.concatenate([v & 15, v >> 4], axis=-1), s, m)

    def packed_2dots(x, p):
        v, s, m = p
        return jnp.concatenate(
            [x @ affine(v & 15, s[:, :half], m[:, :half]), x @ affine(v >> 4, s[:, half:], m[:, half:])], -1
        )

    return {
        "f32": (f32, (w,)),
        "int8": (per_channel, (q8, s8)),
        "fp8": (per_channel, (q_fp8, s_fp8)),
        "u4-groups": (groups_, (q4.astype(jnp.uint4), scale, lo)),
        "u8-groups": (groups_, (q4, scale, lo)),
        "packed-concat": (packed_concat, (packed, scale, lo)),
        "packed-2dots": (packed_2dots, (packed, scale, lo)),
    }, {"int8": q8 * s8[:, None], "fp8": q_fp8.astype(np.float32) * s_fp8[:, None], "4bit": w4}


def run(ns) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    d_in, d_out = ns.shape
    w = (rng.standard_normal((ns.layers, d_in, d_out)) * 0.02).astype(np.float32)
    layouts, dequantized = _layouts(w)
    programs = {}
    stored = {}
    for name, (fn, params) in layouts.items():
        params = tuple(jnp.asarray(p) for p in params)
        stored[name] = sum(p.nbytes for p in params) / w.size  # as the device holds them

        def stack(x, params, fn=fn):  # tanh keeps x bounded over the layers
            return jax.lax.scan(
                lambda x, lp: (jnp.tanh(x + fn(x, lp).sum(-1, keepdims=True)), None), x, params
            )[0]

        programs[name] = (jax.jit(stack), params, jax.jit(fn))
    report: dict = {"bytes_per_weight": stored, "batches": {}}
    for batch in ns.batches:
        x = jnp.asarray(rng.standard_normal((batch, d_in)).astype(np.float32) * 0.1)
        for name, (f, params, layer) in programs.items():  # each layer's product is f32's on its weights
            key = name if name in ("f32", "int8", "fp8") else "4bit"
            want = x @ jnp.asarray(dequantized.get(key, w)[0])
            got = layer(x, tuple(p[0] for p in params))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
            f(x, params).block_until_ready()  # compiled before timing
        times: dict[str, list[float]] = {n: [] for n in programs}
        for _ in range(ns.rounds):
            for name, (f, params, _) in programs.items():
                start = time.perf_counter()
                for _ in range(ns.calls):
                    f(x, params).block_until_ready()
                times[name].append((time.perf_counter() - start) / ns.calls * 1e3)
        report["batches"][str(batch)] = {
            n: {
                "ms": statistics.median(t),
                "ratio_to_f32": statistics.median(a / b for a, b in zip(t, times["f32"])),
            }
            for n, t in times.items()
        }
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/quantized_matmul.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--shape", type=int, nargs=2, default=[576, 1536], metavar=("IN", "OUT"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="Calls timed together in each round.")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    report = run(ns)
    for batch, rows in report["batches"].items():
        for name, r in rows.items():
            print(
                f"b{batch:>3} {name:14s} {r['ms']:8.2f} ms  {r['ratio_to_f32']:5.2f}x f32's time  "
                f"{report['bytes_per_weight'][name]:.2f} bytes/weight",
                flush=True,
            )
    if ns.output_json:
        import json

        with open(ns.output_json, "w") as fh:
            json.dump({"config": vars(ns), "cpu_count": os.cpu_count(), **report}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
