"""GGUF tensors' blocks -> numpy: dequantized to float32, or kept as their groups of 32
(GroupQuantized) for the projections served quantized, and llama.cpp's q/k row order undone.

Where it sits: under gguf.py, which names the tensors and decides which stay grouped; these
functions read one tensor's bytes as ggml lays them out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

_Q = GGMLQuantizationType


@dataclass(frozen=True)
class GroupQuantized:
    """A projection stored in groups of 32 inputs, in Hugging Face's [out, in] layout: integer
    values (int8 for Q8_0; 0..15 as uint8 for the 4-bit formats) and per group a float32 scale
    and, for the 4-bit formats, a min: w = values * scale (+ min)."""

    values: np.ndarray  # [out, in]
    scale: np.ndarray  # [out, in / 32]
    min: np.ndarray | None  # [out, in / 32]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def map(self, fn) -> GroupQuantized:
        """fn applied to the values, the scales and the mins alike (e.g. a transpose)."""
        return GroupQuantized(fn(self.values), fn(self.scale), None if self.min is None else fn(self.min))


def group_blocks(tensor: ReaderTensor, path: str) -> GroupQuantized:
    """A Q8_0 / Q4_0 / Q4_1 / Q4_K tensor's blocks as its groups of 32 (ggml's block layouts:
    a float16 scale (and min) then the values; Q4_K's 256-value super-blocks carry 6-bit
    scales and mins for eight groups, times float16 super-scales)."""
    rows, kind = int(tensor.shape[-1]), tensor.tensor_type
    data = np.asarray(tensor.data).reshape(rows, -1)

    def f16(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a).view(np.float16).astype(np.float32)

    def nibbles(qs: np.ndarray, run: int) -> np.ndarray:
        """Runs of `run` bytes: their low nibbles, then their high nibbles."""
        qs = qs.reshape(*qs.shape[:-1], -1, 1, run) >> np.array([0, 4], np.uint8).reshape(2, 1)
        return (qs & np.uint8(15)).reshape(*qs.shape[:-3], -1)

    if kind == _Q.Q8_0:
        blocks = data.reshape(rows, -1, 34)
        return GroupQuantized(
            np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1),
            f16(blocks[..., :2])[..., 0],
            None,
        )
    if kind in (_Q.Q4_0, _Q.Q4_1):
        size = 18 if kind == _Q.Q4_0 else 20
        blocks = data.reshape(rows, -1, size)
        d = f16(blocks[..., :2])[..., 0]
        m = -8 * d if kind == _Q.Q4_0 else f16(blocks[..., 2:4])[..., 0]
        return GroupQuantized(nibbles(blocks[..., size - 16 :], 16).reshape(rows, -1), d, m)
    if kind == _Q.Q4_K:
        from gguf.quants import Q4_K

        blocks = data.reshape(rows, -1, 144)
        d, dmin = f16(blocks[..., 0:2]), f16(blocks[..., 2:4])  # [rows, n, 1]
        sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
        sc, mn = sc.reshape(*d.shape[:-1], 8), mn.reshape(*d.shape[:-1], 8)
        scale = (d * sc.astype(np.float32)).reshape(rows, -1)
        mins = -(dmin * mn.astype(np.float32)).reshape(rows, -1)
        return GroupQuantized(nibbles(blocks[..., 16:], 32).reshape(rows, -1), scale, mins)
    raise ValueError(f"{path}: tensor {tensor.name!r} ({kind.name}) is not stored in groups of 32")


def dequantize_tensor(tensor: ReaderTensor, path: str) -> np.ndarray:
    # GGUF lists dimensions fastest-moving first; numpy (and HF's [out, in]) is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        weights = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} uses {tensor.tensor_type.name}, which gguf cannot dequantize"
        ) from err
    if weights.size != int(np.prod(shape)):
        raise ValueError(f"{path}: tensor {tensor.name!r} holds {weights.size} values, expected {shape}")
    # A copy: F32 tensors come back as views of the read-only map, and callers may keep or mutate them.
    return np.array(weights.reshape(shape), dtype=np.float32, order="C")


def unpermute_rows(weights: np.ndarray, num_heads: int, name: str, path: str) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation so HF's rotate-half rope applies.

    llama.cpp's converter does ``w.reshape(n, 2, d // 2, ...).swapaxes(1, 2)`` per head (pairing
    row i with row i + d/2 for its interleaved rope); the inverse is the same swap read the other way:
    ``w.reshape(n, d // 2, 2, ...).swapaxes(1, 2)``. Biases (1-D) go through the same rows.
    """
    rows = weights.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{path}: tensor {name!r} has {rows} rows, not a multiple of 2 x {num_heads} heads")
    half = rows // num_heads // 2
    return np.ascontiguousarray(
        weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
    )
