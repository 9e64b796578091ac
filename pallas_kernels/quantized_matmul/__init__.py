"""x @ W for a 4-bit quantized kernel W (one layer of a stack): the native CPU kernel where it
runs, else the pure-jnp reference. See reference.py for the layouts, cpu.cc for the kernel."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import native
from pallas_kernels.quantized_matmul.reference import TILE, is_tiled, q4_matmul_reference, tile, untile

__all__ = ["TILE", "cpu_kernel_applies", "q4_matmul", "q4_matmuls", "q8_head", "tile", "untile"]


def cpu_kernel_applies(x: jax.Array, packed: jax.Array) -> bool:
    """Whether the native kernel computes this product: a float32 x and a kernel in tiles, in a step
    traced for one CPU device (several devices shard the kernel, which the FFI call would gather),
    with the kernels loaded. Any number of rows: from 1 to 2048 the kernel runs 6x to 1.4x faster
    than XLA's dequantize-then-dot (benchmarks/q4_kernel.py)."""
    if x.ndim != 2 or x.dtype != jnp.float32 or not is_tiled(packed):
        return False
    return native.usable_in_trace()


def q4_matmuls(
    x: jax.Array,  # [rows, k]
    stacks: Sequence[tuple[jax.Array, jax.Array, jax.Array]],  # per projection (packed, scale, mins)
    layer: jax.Array,  # [] int32
) -> list[jax.Array]:  # per projection [rows, n] float32
    """x @ W for projections that read the same x (q, k, v; gate, up): one call of the kernel."""
    if not all(cpu_kernel_applies(x, packed) for packed, _, _ in stacks):
        return [q4_matmul_reference(x, *stack, layer) for stack in stacks]
    outs = [
        jax.ShapeDtypeStruct((x.shape[0], packed.shape[1] * TILE), jnp.float32) for packed, _, _ in stacks
    ]
    call = jax.ffi.ffi_call("jaxserve_q4_matmul", outs, vmap_method="sequential")
    return list(call(x, jnp.asarray(layer, jnp.int32), *(a for stack in stacks for a in stack)))


def q4_matmul(
    x: jax.Array,  # [rows, k]
    packed: jax.Array,  # [layers, k / 2, n] uint8, or in tiles (reference.py)
    scale: jax.Array,  # [layers, k / 64, 2, n] float32, or in tiles
    mins: jax.Array,  # as scale
    layer: jax.Array,  # [] int32
) -> jax.Array:  # [rows, n] float32
    return q4_matmuls(x, [(packed, scale, mins)], layer)[0]


def q8_head(
    x: jax.Array,  # [rows, k] float32
    table: jax.Array,  # [vocab, k] int8 (GGUF Q8_0 values)
    scale: jax.Array,  # [vocab, k / 32] float32
) -> jax.Array | None:  # [rows, vocab] float32
    """x @ table.T with the table dequantized, by the native kernel (cpu.cc Q8Head: the table read
    once for every row); None where the kernel cannot run (not a float32 x on one CPU device with the
    kernels loaded), for the caller's own path."""
    if x.ndim != 2 or x.dtype != jnp.float32 or table.dtype != jnp.int8 or not native.usable_in_trace():
        return None
    out = jax.ShapeDtypeStruct((x.shape[0], table.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("jaxserve_q8_head", out, vmap_method="sequential")(x, table, scale)
