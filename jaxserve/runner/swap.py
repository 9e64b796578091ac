"""Swap preemption's copies (engine/swap_space.py decides them): a request's KV pages out of the
pool into host memory, and back into other pages, before a step runs.

A request's pages are the same page ids in every layer (kv_cache.py: layer l's copy of page p is
row l * blocks_per_layer + p of the pool), so one gather takes them all: [num_layers * pages,
2 * num_kv_heads, page_size, head_dim], split over the devices like the pool. The count of pages
is rounded up to a power of two (at most the pages of a whole sequence) so that a few programs
serve every request: padding reads page 0 (never handed out) and writes nowhere. Where the devices
have a pinned host memory, the copy is kept there (`memory_kind="pinned_host"`); a CPU's pool is
host memory already.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.scheduler_output import SwapOps


def _gather(pool: jax.Array, rows: jax.Array) -> jax.Array:
    return pool[rows]


def _scatter(pool: jax.Array, rows: jax.Array, pages: jax.Array) -> jax.Array:
    return pool.at[rows].set(pages.astype(pool.dtype), mode="drop")


class SwapBuffers:
    def __init__(self, num_layers: int, blocks_per_layer: int, pages_per_seq: int):
        self.num_layers, self.blocks_per_layer, self.pages_per_seq = (
            num_layers,
            blocks_per_layer,
            pages_per_seq,
        )
        self.host: dict[str, jax.Array] = {}  # request id -> its pages, padded to a power of two
        self._gather = jax.jit(_gather)
        self._scatter = jax.jit(_scatter, donate_argnums=(0,))

    @classmethod
    def of(cls, preemption_mode: str, layout) -> SwapBuffers | None:
        """The buffers of a pool in this layout (a StepLayout), with swap preemption."""
        if preemption_mode != "swap":
            return None
        return cls(layout.kv_spec.num_layers, layout.num_blocks, layout.pages_per_seq)

    def apply(self, pool: jax.Array, ops: SwapOps) -> jax.Array:
        """Run a step's copies in order (out, in, drop); the pool after them."""
        for req_id, pages in ops.out:
            rows = self._rows(pages, pad_row=0)
            self.host[req_id] = _to_host(self._gather(pool, jnp.asarray(rows)))
        for req_id, pages in ops.into:
            data = self.host.pop(req_id)
            rows = self._rows(pages, pad_row=pool.shape[0], bucket=data.shape[0] // self.num_layers)
            pool = self._scatter(pool, jnp.asarray(rows), jax.device_put(data, pool.sharding))
        for req_id in ops.drop:
            self.host.pop(req_id, None)
        return pool

    def _rows(self, pages: tuple[int, ...], pad_row: int, bucket: int | None = None) -> np.ndarray:
        """[num_layers * bucket] pool rows of the pages in every layer, padded with pad_row."""
        if bucket is None:
            bucket = min(1 << max(len(pages) - 1, 0).bit_length(), max(self.pages_per_seq, len(pages)))
        padded = np.full(bucket, -1, np.int64)
        padded[: len(pages)] = pages
        rows = np.arange(self.num_layers)[:, None] * self.blocks_per_layer + padded[None, :]
        return np.where(padded[None, :] >= 0, rows, pad_row).astype(np.int32).ravel()


def _to_host(x: jax.Array) -> jax.Array:
    """x in the devices' pinned host memory where they have one (the pool's own memory otherwise)."""
    kinds = {m.kind for m in next(iter(x.sharding.device_set)).addressable_memories()}
    if "pinned_host" not in kinds or x.sharding.memory_kind == "pinned_host":
        return x
    return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
