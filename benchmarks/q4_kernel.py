"""The native 4-bit CPU kernel against XLA's dequantize-then-dot (its jnp reference), by rows of x.

A decoder's projections as the default model runs them (30 layers of q+k+v, o, gate+up and down
at SmolLM2-135M's shapes, random 4-bit weights), one lax.scan over the layers per call: the kernel
on the stacks in its tiles, the reference on the same bytes untiled. Rounds alternate the two;
per row count, the median time of a call of all layers and the kernel's speed-up. (It showed the
kernel ahead at every row count, so a step runs it for decodes and prefills alike.)

    python benchmarks/q4_kernel.py [--rows 1 8 32 128 256 512] [--rounds 5] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native
from pallas_kernels.quantized_matmul import q4_matmuls, tile
from pallas_kernels.quantized_matmul.reference import q4_matmul_reference

# (input width, output widths of the projections that share the input)
LAYER = ((576, (576, 192, 192)), (576, (576,)), (576, (1536, 1536)), (1536, (576,)))


def _stacks(rng, layers: int):
    out = []
    for k, widths in LAYER:
        group = []
        for n in widths:
            packed = rng.integers(0, 256, (layers, k // 2, n), dtype=np.uint8)
            scale = (rng.random((layers, k // 64, 2, n)) * 0.02).astype(np.float32)
            mins = (-rng.random((layers, k // 64, 2, n)) * 0.1).astype(np.float32)
            group.append((packed, scale, mins))
        out.append(group)
    return out


def _model(stacks, kernel: bool):
    def layer(x, i):
        total = 0.0
        for (k, _), group in zip(LAYER, stacks):
            xs = x[:, :k] if k <= x.shape[1] else jnp.tile(x, (1, k // x.shape[1] + 1))[:, :k]
            if kernel:
                ys = q4_matmuls(xs, group, i)
            else:
                ys = [q4_matmul_reference(xs, *stack, i) for stack in group]
            total = total + sum(y[:, :576].sum(axis=1, keepdims=True) for y in ys)
        return jnp.tanh(x + 1e-3 * total), None

    layers = stacks[0][0][0].shape[0]
    return jax.jit(lambda x: jax.lax.scan(layer, x, jnp.arange(layers, dtype=jnp.int32))[0])


def run(ns) -> dict:
    if not native.load():
        raise SystemExit("the native kernels did not build")
    rng = np.random.default_rng(0)
    plain = [[tuple(map(jnp.asarray, s)) for s in group] for group in _stacks(rng, ns.layers)]
    tiled = [[tuple(map(jnp.asarray, tile(*s))) for s in group] for group in plain]
    results = {}
    for rows in ns.rows:
        x = jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32))
        fns = {"kernel": _model(tiled, True), "xla": _model(plain, False)}
        outs = {name: np.asarray(fn(x)) for name, fn in fns.items()}
        np.testing.assert_allclose(outs["kernel"], outs["xla"], rtol=1e-3, atol=1e-3)
        times = {name: [] for name in fns}
        for r in range(ns.rounds):
            for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                start = time.perf_counter()
                fns[name](x).block_until_ready()
                times[name].append(time.perf_counter() - start)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        results[rows] = {
            **{f"{n}_ms": round(v, 3) for n, v in ms.items()},
            "speedup": round(ms["xla"] / ms["kernel"], 2),
        }
        print(
            f"rows {rows:4d}: kernel {ms['kernel']:8.2f} ms  xla {ms['xla']:8.2f} ms  speed-up {results[rows]['speedup']:.2f}x"
        )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/q4_kernel.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 256, 512])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    results = run(ns)
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            json.dump({"config": {**vars(ns), "cpu_count": os.cpu_count()}, "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
