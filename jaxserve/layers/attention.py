"""The attention models call: writes the step's keys and values into the paged pool, then
runs ragged paged attention with the backend chosen for the platform.

On CPU the pure-jnp reference is the backend; Pallas kernels for TPU and GPU plug in
here behind the same signature.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention, write_kv


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # [num_tokens] int32, slot within one layer's pages; padding >= pool size
    kv_lens: jax.Array  # [max_num_seqs] int32, tokens in cache after this step
    page_indices: jax.Array  # [max_num_seqs, pages_per_seq] int32, pages within one layer
    cu_q_lens: jax.Array  # [max_num_seqs + 1] int32
    num_seqs: jax.Array  # [1] int32


def paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    kv_pool: jax.Array,  # [num_layers * pages_per_layer, 2 * num_kv_heads, page_size, head_dim]
    layer: jax.Array,  # [] int32
    pages_per_layer: int,
    meta: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,  # traced: a per-layer choice (see the reference)
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:  # ([num_tokens, num_q_heads, head_dim], kv_pool)
    page_offset = layer * pages_per_layer
    page_size = kv_pool.shape[2]
    kv_pool = write_kv(kv_pool, k, v, meta.slot_mapping + page_offset * page_size)
    out = ragged_paged_attention(
        q,
        kv_pool,
        meta.kv_lens,
        meta.page_indices + page_offset,
        meta.cu_q_lens,
        meta.num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    return out, kv_pool
