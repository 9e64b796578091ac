"""Pure-jnp 4-bit matmul: the reference the CPU kernel (cpu.cc) is tested against, and what runs
wherever the kernel does not (TPU, GPU, several devices, no C++ compiler).

The kernel is one layer of a stack [layers, k / 2, n] of bytes, two 4-bit values each: byte row
32b + i holds input 64b + i (low nibble) and input 64b + 32 + i (high nibble), so each nibble is a
whole group of 32 inputs and the two halves of x feed two dots whose results add (XLA:CPU unpacks
inside each dot's operand fusion); w = q * scale + min per group, scales and mins
[layers, k / 64, 2, n], the low nibbles' first.

The CPU kernel reads the same bytes in tiles of 64 output columns (`tile`): packed
[layers, n / 64, k / 2, 64], scales and mins [layers, n / 64, k / 64, 2, 64], each tile contiguous, so
that it streams from memory. The reference takes either layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP = 32  # inputs per scale and min
TILE = 64  # output columns per tile of the CPU kernel's layout


def _to_tiles(a, row_axes: int):
    """[..., *rows, n] -> [..., n / 64, *rows, 64]."""
    lead = a.ndim - 1 - row_axes
    tiles = a.reshape(*a.shape[:-1], a.shape[-1] // TILE, TILE)
    return tiles.transpose(*range(lead), lead + row_axes, *range(lead, lead + row_axes), lead + row_axes + 1)


def _from_tiles(a, row_axes: int):
    """[..., n / 64, *rows, 64] -> [..., *rows, n]."""
    lead = a.ndim - 2 - row_axes
    moved = a.transpose(*range(lead), *range(lead + 1, lead + 1 + row_axes), lead, lead + 1 + row_axes)
    return moved.reshape(*moved.shape[:-2], -1)


def tile(packed, scale, mins):
    """4-bit values [..., k / 2, n] with scales and mins [..., k / 64, 2, n] -> the same in tiles of
    64 output columns (n a multiple of 64): [..., n / 64, k / 2, 64] and [..., n / 64, k / 64, 2, 64].
    numpy arrays or jax ones."""
    return _to_tiles(packed, 1), _to_tiles(scale, 2), _to_tiles(mins, 2)


def untile(packed, scale, mins):
    """The inverse of `tile`."""
    return _from_tiles(packed, 1), _from_tiles(scale, 2), _from_tiles(mins, 2)


def is_tiled(packed: jax.Array) -> bool:
    """Whether a stack [layers, ...] is in the CPU kernel's tiles ([layers, n / 64, k / 2, 64])."""
    return packed.ndim == 4


def dequantize_groups(values: jax.Array, scale: jax.Array, mins: jax.Array | None = None) -> jax.Array:
    """Group-quantized values [in, out] with their [in / rows, out] scales (and mins: None for a
    symmetric format), a scale per `rows` inputs -> float32."""
    d_in, d_out = values.shape
    groups = scale.shape[0]
    w = values.astype(jnp.float32).reshape(groups, d_in // groups, d_out) * scale[:, None]
    return (w if mins is None else w + mins[:, None]).reshape(d_in, d_out)


def q4_matmul_reference(
    x: jax.Array,  # [rows, k]
    packed: jax.Array,  # [layers, k / 2, n] uint8 (or tiled: [layers, n / 64, k / 2, 64])
    scale: jax.Array,  # [layers, k / 64, 2, n] float32 (or tiled: [layers, n / 64, k / 64, 2, 64])
    mins: jax.Array,  # as scale
    layer: jax.Array,  # [] int32
) -> jax.Array:  # [rows, n] float32
    kernel, s, m = packed[layer], scale[layer], mins[layer]
    if is_tiled(packed):  # the layer's tiles joined (XLA fuses it into the dequantization)
        kernel, s, m = untile(kernel, s, m)
    xs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2, GROUP)  # [rows, k / 64, 2, 32]
    halves = [(kernel & 15, xs[..., 0, :]), (kernel >> 4, xs[..., 1, :])]
    return sum(
        jnp.dot(part.reshape(*x.shape[:-1], -1), dequantize_groups(nibble, s[:, i], m[:, i]))
        for i, (nibble, part) in enumerate(halves)
    )
