"""x @ W for a 4-bit quantized kernel W (one layer of a stack): the native CPU kernel where it
pays, else the pure-jnp reference. See reference.py for the layout, cpu.cc for the kernel."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import native
from pallas_kernels.quantized_matmul.reference import q4_matmul_reference

# Rows of x up to which the kernel beats XLA's dequantize-then-dot on a CPU (measured with
# benchmarks/decode_profile.py --kernels: 2.4x at 1 row, 1.3x at 4, slower from 8).
CPU_KERNEL_MAX_ROWS = 4


def cpu_kernel_applies(x: jax.Array) -> bool:
    """Whether the native kernel computes this product: a float32 x of few rows, in a step traced
    for one CPU device (several devices shard the kernel, which the FFI call would gather), with the
    kernels loaded."""
    if x.ndim != 2 or x.dtype != jnp.float32 or x.shape[0] > CPU_KERNEL_MAX_ROWS:
        return False
    return native.usable_in_trace()


def q4_matmuls(
    x: jax.Array,  # [rows, k]
    stacks: Sequence[tuple[jax.Array, jax.Array, jax.Array]],  # per projection (packed, scale, mins)
    layer: jax.Array,  # [] int32
) -> list[jax.Array]:  # per projection [rows, n] float32
    """x @ W for projections that read the same x (q, k, v; gate, up): one call of the kernel."""
    if not cpu_kernel_applies(x) or any(packed.shape[-1] % 64 for packed, _, _ in stacks):
        return [q4_matmul_reference(x, *stack, layer) for stack in stacks]
    outs = [jax.ShapeDtypeStruct((x.shape[0], packed.shape[-1]), jnp.float32) for packed, _, _ in stacks]
    call = jax.ffi.ffi_call("jaxserve_q4_matmul", outs, vmap_method="sequential")
    return list(call(x, jnp.asarray(layer, jnp.int32), *(a for stack in stacks for a in stack)))


def q4_matmul(
    x: jax.Array,  # [rows, k]
    packed: jax.Array,  # [layers, k / 2, n] uint8
    scale: jax.Array,  # [layers, k / 64, 2, n] float32
    mins: jax.Array,  # [layers, k / 64, 2, n] float32
    layer: jax.Array,  # [] int32
) -> jax.Array:  # [rows, n] float32
    return q4_matmuls(x, [(packed, scale, mins)], layer)[0]
