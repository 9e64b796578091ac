"""Ragged paged-attention test cases, built one way for every attention test.

The reference, the TPU and GPU kernels (interpreted, and compiled on a device) are all checked
on the same kind of batch: sequences given as (context_len, q_len), their pages scattered
through one pool, padding query rows and padding sequence slots after them, and as the answer
plain numpy attention over each sequence's dense keys. One builder keeps that layout, and the
way the answer is read back through the page tables, the same for every implementation; each
test still chooses its own sequences, sizes and data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention.reference import quantize, write_kv

# float32 on both sides: an implementation and dense attention sum in (at least) float32, in
# different orders; they agree to ~2e-6 on these unit-variance inputs.
F32_TOL = dict(atol=2e-5, rtol=1e-5)


def dense_attention(q, k, v, start, sm_scale, sliding_window=None, soft_cap=None):
    """q [n, Hq, D] at positions start..start+n-1; k/v [start+n, Hkv, D]."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    k = np.repeat(k, hq // hkv, axis=1)
    v = np.repeat(v, hq // hkv, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    qpos = start + np.arange(n)[:, None]
    kpos = np.arange(k.shape[0])[None, :]
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def token_major(kv_pages):
    """[pages, 2 * heads, page, d] -> [pages * page, heads, 2 (k|v), d]."""
    pages, combined, page_size, d = kv_pages.shape
    return np.asarray(kv_pages).transpose(0, 2, 1, 3).reshape(pages * page_size, combined // 2, 2, d)


@dataclass(frozen=True)
class AttentionCase:
    """One batch in the attention functions' argument order (`args`), and its sequences."""

    q: jax.Array  # [num_tokens, num_q_heads, head_dim]: the sequences' rows back to back, then padding
    kv: jax.Array  # [num_pages, 2 * num_kv_heads, page_size, head_dim], k and v interleaved per head
    kv_lens: jax.Array  # [max_num_seqs] int32, 0 past the sequences
    page_indices: jax.Array  # [max_num_seqs, pages_per_seq] int32
    cu_q_lens: jax.Array  # [max_num_seqs + 1] int32
    num_seqs: jax.Array  # [1] int32
    seqs: tuple[tuple[int, int], ...]  # (context_len, q_len) per sequence
    # A pool of quantized pages (int8, fp8) holds k / k_scale and v / v_scale (quantized()).
    k_scale: float | None = None
    v_scale: float | None = None

    @property
    def args(self) -> tuple[jax.Array, ...]:
        return (self.q, self.kv, self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs)

    @property
    def scales(self) -> dict:
        """The keyword arguments that tell an implementation the pool's scales."""
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)

    def quantized(self, dtype, k_scale: float, v_scale: float) -> AttentionCase:
        """The same batch over the pool quantized to `dtype` pages (as write_kv stores them)."""
        kv = np.asarray(self.kv, np.float32)
        pages = np.empty(kv.shape, jnp.dtype(dtype))
        pages[:, 0::2] = np.asarray(quantize(jnp.asarray(kv[:, 0::2]), k_scale, jnp.dtype(dtype)))
        pages[:, 1::2] = np.asarray(quantize(jnp.asarray(kv[:, 1::2]), v_scale, jnp.dtype(dtype)))
        return dataclasses.replace(self, kv=jnp.asarray(pages), k_scale=k_scale, v_scale=v_scale)

    @property
    def sm_scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    @property
    def num_rows(self) -> int:
        """Query rows of the sequences; the rows after them are padding."""
        return sum(q_len for _, q_len in self.seqs)

    def expected(self, sliding_window=None, soft_cap=None) -> np.ndarray:
        """Every sequence's rows by dense numpy attention in float64 on the (possibly bfloat16)
        inputs, over the keys and values its page table points at (a quantized pool's pages
        times their scales); padding rows zero."""
        q = np.asarray(self.q, np.float64)
        page_size = self.kv.shape[2]
        pool = np.asarray(self.kv, np.float64)
        if self.k_scale is not None:  # the values the quantized pages stand for
            pool[:, 0::2] *= self.k_scale
            pool[:, 1::2] *= self.v_scale
        pool = token_major(pool)
        pages, cu = np.asarray(self.page_indices), np.asarray(self.cu_q_lens)
        out = np.zeros_like(q)
        for i, (ctx, q_len) in enumerate(self.seqs):
            pos = np.arange(ctx + q_len)
            flat = pages[i, pos // page_size] * page_size + pos % page_size
            rows = slice(int(cu[i]), int(cu[i + 1]))
            out[rows] = dense_attention(
                q[rows], pool[flat, :, 0], pool[flat, :, 1], ctx, self.sm_scale, sliding_window, soft_cap
            )
        return out


def build_case(
    rng: np.random.Generator,
    seqs,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    max_num_seqs: int,
    num_tokens: int,
    pages_per_seq: int = 0,
    dtype=jnp.float32,
    write_new_kv: bool = False,
    fill_unused_slots: bool = True,
    nan_padding: bool = False,
) -> AttentionCase:
    """A batch of `seqs`, (context_len, q_len) per sequence, in `max_num_seqs` slots and
    `num_tokens` query rows. Every slot's page table has `pages_per_seq` pages (or as many as
    the longest sequence needs, if more), all drawn without repeats from a pool of random keys
    and values whose page 0 is never handed out.

    write_new_kv: the new tokens' keys and values are written into the pool with write_kv, as
    a step does before it attends (padding rows to a slot past the pool), rather than found in it.
    fill_unused_slots: the slots past the sequences keep page tables, as stale ones from an
    earlier step would; False leaves them zero, as the runner pads them.
    nan_padding: padding query rows are NaN, so that mixing them into real rows shows.
    """
    needed = max((-(-(ctx + q_len) // page_size) for ctx, q_len in seqs), default=0)
    pages_per_seq = max(pages_per_seq, needed)
    num_pages = 1 + max_num_seqs * pages_per_seq
    kv = jnp.asarray(rng.standard_normal((num_pages, 2 * num_kv_heads, page_size, head_dim)), dtype)
    pages = (1 + rng.permutation(max_num_seqs * pages_per_seq)).reshape(max_num_seqs, pages_per_seq)
    if not fill_unused_slots:
        pages[len(seqs) :] = 0
    q_lens = np.zeros(max_num_seqs, np.int32)
    kv_lens = np.zeros(max_num_seqs, np.int32)
    for i, (ctx, q_len) in enumerate(seqs):
        q_lens[i], kv_lens[i] = q_len, ctx + q_len
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim))
    if nan_padding:
        q[cu[-1] :] = np.nan
    if write_new_kv:
        kv = _write_new_kv(rng, kv, seqs, pages, num_tokens)
    return AttentionCase(
        q=jnp.asarray(q, dtype),
        kv=kv,
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(pages, jnp.int32),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([len(seqs)], jnp.int32),
        seqs=tuple(seqs),
    )


def _write_new_kv(rng, kv, seqs, pages, num_tokens):
    """Random keys and values for each sequence's new tokens, written at their slots; the
    padding rows' (zeros) go to a slot past the pool, which write_kv drops."""
    num_pages, combined, page_size, head_dim = kv.shape
    num_kv_heads = combined // 2
    slots, ks, vs = [], [], []
    for i, (ctx, q_len) in enumerate(seqs):
        pos = ctx + np.arange(q_len)
        slots.append(pages[i, pos // page_size] * page_size + pos % page_size)
        ks.append(rng.standard_normal((q_len, num_kv_heads, head_dim)))
        vs.append(rng.standard_normal((q_len, num_kv_heads, head_dim)))
    pad_tokens = num_tokens - sum(q_len for _, q_len in seqs)
    padding = [np.zeros((pad_tokens, num_kv_heads, head_dim))]
    k_new = jnp.asarray(np.concatenate(ks + padding), kv.dtype)
    v_new = jnp.asarray(np.concatenate(vs + padding), kv.dtype)
    pad_slot = num_pages * page_size
    slot_mapping = jnp.asarray(np.concatenate(slots + [np.full(pad_tokens, pad_slot)]).astype(np.int32))
    return write_kv(kv, k_new, v_new, slot_mapping)


def _lengths(page):
    return [1, page - 1, page, page + 1, 3 * page + 5]


# Batches of five sequences around page boundaries: 1, page - 1, page, page + 1 and a few
# pages, as the contexts of decodes, as prompts, or mixed with chunked prefills.
MIXES = {
    "decode": lambda p: [(c, 1) for c in _lengths(p)],
    "prefill": lambda p: [(0, n) for n in _lengths(p)],
    "mixed": lambda p: [(0, 70), (p + 3, 1), (2 * p, p + 1), (5, 1), (p - 1, 130)],
}

# The layout the reference and GPU tests give build_case: fixed array sizes, so that cases
# differing only in data share one compilation; the new tokens' keys and values written as a
# step writes them; the unused slots' page tables zero, as the runner pads them.
PADDED_LAYOUT = dict(num_tokens=384, pages_per_seq=16, write_new_kv=True, fill_unused_slots=False)

# Quantized pages: (dtype, k_scale, v_scale). The unit-variance keys and values reach ~4.5,
# so int8 at these scales saturates the largest few, and fp8 rounds to its 3 (e4m3) or 2
# (e5m2) mantissa bits: the expected output is computed from the pages as stored, times the
# scales, so any error here is the attention's, not the quantization's.
QUANTIZED = [("int8", 0.03, 0.05), ("float8_e4m3fn", 0.02, 0.5), ("float8_e5m2", 1.0, 0.25)]
