"""Pure-jnp 4-bit matmul: the reference the CPU kernel (cpu.cc) is tested against, and what runs
wherever the kernel does not (TPU, GPU, several devices, larger batches, no C++ compiler).

The kernel is one layer of a stack [layers, k / 2, n] of bytes, two 4-bit values each: byte row
32b + i holds input 64b + i (low nibble) and input 64b + 32 + i (high nibble), so each nibble is a
whole group of 32 inputs and the two halves of x feed two dots whose results add (XLA:CPU unpacks
inside each dot's operand fusion); w = q * scale + min per group, scales and mins
[layers, k / 64, 2, n], the low nibbles' first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP = 32  # inputs per scale and min


def dequantize_groups(values: jax.Array, scale: jax.Array, mins: jax.Array | None = None) -> jax.Array:
    """Group-quantized values [in, out] with their [in / rows, out] scales (and mins: None for a
    symmetric format), a scale per `rows` inputs -> float32."""
    d_in, d_out = values.shape
    groups = scale.shape[0]
    w = values.astype(jnp.float32).reshape(groups, d_in // groups, d_out) * scale[:, None]
    return (w if mins is None else w + mins[:, None]).reshape(d_in, d_out)


def q4_matmul_reference(
    x: jax.Array,  # [rows, k]
    packed: jax.Array,  # [layers, k / 2, n] uint8
    scale: jax.Array,  # [layers, k / 64, 2, n] float32
    mins: jax.Array,  # [layers, k / 64, 2, n] float32
    layer: jax.Array,  # [] int32
) -> jax.Array:  # [rows, n] float32
    kernel, s, m = packed[layer], scale[layer], mins[layer]
    xs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2, GROUP)  # [rows, k / 64, 2, 32]
    halves = [(kernel & 15, xs[..., 0, :]), (kernel >> 4, xs[..., 1, :])]
    return sum(
        jnp.dot(part.reshape(*x.shape[:-1], -1), dequantize_groups(nibble, s[:, i], m[:, i]))
        for i, (nibble, part) in enumerate(halves)
    )
