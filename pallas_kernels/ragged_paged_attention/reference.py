"""Pure-jnp ragged paged attention: the reference every kernel is tested against, and the
path the engine runs on CPU.

## The KV layout (shared by the reference and every kernel)

    kv_pages: [num_pages, page_size, 2 * num_kv_heads, head_dim]

Page-major: one page holds `page_size` consecutive tokens of one sequence, and for each
token the keys and values of every KV head side by side, interleaved as
(k_0, v_0, k_1, v_1, ...). Interleaving keeps a head's K and V in the same shard when the
head axis is split over a mesh, and one page read brings both. The engine stacks the
pages of all layers into one pool (layer l owns pages [l * pages_per_layer, (l+1) *
pages_per_layer)) and offsets `page_indices` by layer, so this signature never sees layers.

## The ragged batch

The flat query batch holds the new tokens of `num_seqs` sequences back to back: sequence
i owns rows cu_q_lens[i]:cu_q_lens[i+1]. kv_lens[i] counts its tokens in the cache
*including* the new ones (which write_kv stored before attention runs), so the new
tokens sit at positions kv_lens[i] - q_len_i ... kv_lens[i] - 1 and attend causally to
everything up to and including themselves. Prefill chunks and decodes (q_len 1) mix
freely. Rows past cu_q_lens[num_seqs] are padding: their output is zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Keys are visited in chunks of this many tokens with an online softmax, so memory stays
# bounded by [num_tokens, chunk] whatever the context length.
KV_CHUNK_TOKENS = 128


def write_kv(
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [num_tokens] int32: page * page_size + offset; >= num_slots drops
) -> jax.Array:  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    num_pages, page_size, combined, head_dim = kv_pages.shape
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], combined, head_dim).astype(kv_pages.dtype)
    flat = kv_pages.reshape(num_pages * page_size, combined, head_dim)
    flat = flat.at[slot_mapping].set(kv, mode="drop")
    return flat.reshape(kv_pages.shape)


def ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # [max_num_seqs] int32
    page_indices: jax.Array,  # [max_num_seqs, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [max_num_seqs + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [num_tokens, num_q_heads, head_dim]
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, combined, _ = kv_pages.shape
    num_kv_heads = combined // 2
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_indices.shape[1]
    chunk_pages = max(1, min(pages_per_seq, KV_CHUNK_TOKENS // page_size))
    chunk = chunk_pages * page_size
    if pages_per_seq % chunk_pages:
        # Pad the page table to whole chunks; the extra entries lie past every kv_len.
        pad = chunk_pages - pages_per_seq % chunk_pages
        page_indices = jnp.pad(page_indices, ((0, 0), (0, pad)))

    # Which sequence each query row belongs to, and its absolute position.
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    valid = rows < cu_q_lens[num_seqs[0]]
    seq = jnp.where(valid, seq, 0)
    q_start = cu_q_lens[seq]
    q_len = cu_q_lens[seq + 1] - q_start
    q_pos = kv_lens[seq] - q_len + (rows - q_start)  # [num_tokens]
    q_pos = jnp.where(valid, q_pos, -1)  # padding rows see no key
    token_pages = page_indices[seq]  # [num_tokens, pages_per_seq]

    qg = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, head_dim)
    max_len = jnp.max(jnp.where(jnp.arange(kv_lens.shape[0]) < num_seqs[0], kv_lens, 0))
    num_chunks = (max_len + chunk - 1) // chunk

    def body(c, carry):
        m, l_sum, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(token_pages, c * chunk_pages, chunk_pages, axis=1)
        kv = kv_pages[pages]  # [num_tokens, chunk_pages, page_size, 2 * num_kv_heads, head_dim]
        kv = kv.reshape(num_tokens, chunk, num_kv_heads, 2, head_dim).astype(jnp.float32)
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]  # [num_tokens, chunk, num_kv_heads, head_dim]
        s = jnp.einsum("tkgd,tckd->tkgc", qg, k)  # [num_tokens, num_kv_heads, group, chunk]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = k_pos[None, :] <= q_pos[:, None]  # [num_tokens, chunk]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l_sum = alpha * l_sum + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("tkgc,tckd->tkgd", p, v)
        return m_new, l_sum, acc

    init = (
        jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, l_sum, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
