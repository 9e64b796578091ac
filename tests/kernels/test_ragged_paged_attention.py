"""The reference ragged paged attention against a plain numpy attention over each
sequence's dense keys: every layout detail (pages, interleaved k/v, ragged rows,
padding) has to be right for the two to agree."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention, write_kv


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


# Fixed array sizes, so that cases differing only in data share one compilation.
NUM_TOKENS = 384
PAGES_PER_SEQ = 16


def build_case(rng, seqs, num_q_heads, num_kv_heads, head_dim, page_size, max_num_seqs):
    """seqs: list of (context_len, q_len). Returns inputs and the expected output."""
    pages_per_seq = max(PAGES_PER_SEQ, max(-(-(c + q) // page_size) for c, q in seqs))
    num_pages = 1 + max_num_seqs * pages_per_seq
    kv_pages = jnp.asarray(rng.normal(size=(num_pages, 2 * num_kv_heads, page_size, head_dim)), jnp.float32)
    perm = rng.permutation(np.arange(1, num_pages))  # pages scattered through the pool
    page_indices = np.zeros((max_num_seqs, pages_per_seq), np.int32)
    num_tokens = NUM_TOKENS
    pad_tokens = num_tokens - sum(q for _, q in seqs)
    q = rng.normal(size=(num_tokens, num_q_heads, head_dim)).astype(np.float32)
    cu = np.zeros(max_num_seqs + 1, np.int32)
    kv_lens = np.zeros(max_num_seqs, np.int32)
    slots, ks, vs = [], [], []
    for i, (ctx, ql) in enumerate(seqs):
        page_indices[i] = perm[i * pages_per_seq : (i + 1) * pages_per_seq]
        cu[i + 1] = cu[i] + ql
        kv_lens[i] = ctx + ql
        pos = ctx + np.arange(ql)
        slots.append(page_indices[i, pos // page_size] * page_size + pos % page_size)
        ks.append(rng.normal(size=(ql, num_kv_heads, head_dim)))
        vs.append(rng.normal(size=(ql, num_kv_heads, head_dim)))
    cu[len(seqs) + 1 :] = cu[len(seqs)]
    k_new = jnp.asarray(np.concatenate(ks + [np.zeros((pad_tokens, num_kv_heads, head_dim))]), jnp.float32)
    v_new = jnp.asarray(np.concatenate(vs + [np.zeros((pad_tokens, num_kv_heads, head_dim))]), jnp.float32)
    pad_slot = num_pages * page_size
    slot_mapping = jnp.asarray(np.concatenate(slots + [np.full(pad_tokens, pad_slot)]).astype(np.int32))
    kv_pages = write_kv(kv_pages, k_new, v_new, slot_mapping)

    pool = token_major(kv_pages)
    expected = np.zeros_like(q)
    sm_scale = head_dim**-0.5
    for i, (ctx, ql) in enumerate(seqs):
        pos = np.arange(ctx + ql)
        flat = page_indices[i, pos // page_size] * page_size + pos % page_size
        k, v = pool[flat, :, 0], pool[flat, :, 1]
        expected[cu[i] : cu[i + 1]] = dense_attention(q[cu[i] : cu[i + 1]], k, v, ctx, sm_scale)
    inputs = (jnp.asarray(q), kv_pages, jnp.asarray(kv_lens), jnp.asarray(page_indices), jnp.asarray(cu))
    return inputs, jnp.asarray([len(seqs)], jnp.int32), expected, sm_scale


def assert_matches_dense(out, q, kv, pages, cu, seqs, scale, window=None, cap=None, page_size=16):
    """Each sequence's rows of `out` against dense attention over its keys and values."""
    pool = token_major(kv)
    cu_np, pages_np = np.asarray(cu), np.asarray(pages)
    for i, (ctx, ql) in enumerate(seqs):
        pos = np.arange(ctx + ql)
        flat = pages_np[i, pos // page_size] * page_size + pos % page_size
        rows = slice(cu_np[i], cu_np[i + 1])
        want = dense_attention(
            np.asarray(q)[rows], pool[flat, :, 0], pool[flat, :, 1], ctx, scale, window, cap
        )
        np.testing.assert_allclose(np.asarray(out)[rows], want, atol=2e-5, rtol=1e-5)


def token_major(kv_pages):
    """[pages, 2 * heads, page, d] -> [pages * page, heads, 2 (k|v), d]."""
    pages, combined, page_size, d = kv_pages.shape
    return np.asarray(kv_pages).transpose(0, 2, 1, 3).reshape(pages * page_size, combined // 2, 2, d)


def _lengths(page):
    return [1, page - 1, page, page + 1, 3 * page + 5]


MIXES = {
    "decode": lambda p: [(c, 1) for c in _lengths(p)],
    "prefill": lambda p: [(0, n) for n in _lengths(p)],
    "mixed": lambda p: [(0, 70), (p + 3, 1), (2 * p, p + 1), (5, 1), (p - 1, 130)],
}


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_reference_matches_dense(group, head_dim, page_size, mix):
    rng = np.random.default_rng(group * 1000 + head_dim + page_size)
    seqs = MIXES[mix](page_size)
    num_kv_heads = 2
    (q, kv, kv_lens, pages, cu), num_seqs, expected, scale = build_case(
        rng, seqs, num_kv_heads * group, num_kv_heads, head_dim, page_size, max_num_seqs=8
    )
    out = _jitted_reference(scale)(q, kv, kv_lens, pages, cu, num_seqs)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=1e-5)


@functools.cache
def _jitted_reference(sm_scale):
    """One jitted reference per scale: the three mixes of a configuration share its shapes,
    so they share one compilation."""
    return jax.jit(functools.partial(ragged_paged_attention, sm_scale=sm_scale))


def test_padding_rows_are_zero():
    rng = np.random.default_rng(0)
    (q, kv, kv_lens, pages, cu), num_seqs, _, scale = build_case(rng, [(3, 2), (0, 4)], 4, 2, 64, 16, 4)
    out = np.asarray(ragged_paged_attention(q, kv, kv_lens, pages, cu, num_seqs, sm_scale=scale))
    assert np.all(out[6:] == 0.0) and out.shape[0] > 6
    assert np.all(np.abs(out[:6]).sum(axis=(1, 2)) > 0)


@pytest.mark.parametrize("window, cap", [(7, None), (None, 5.0), (20, 2.0)])
def test_sliding_window_and_soft_cap(window, cap):
    rng = np.random.default_rng(1)
    seqs = [(40, 1), (0, 50), (25, 9)]
    (q, kv, kv_lens, pages, cu), num_seqs, _, scale = build_case(rng, seqs, 4, 2, 64, 16, 4)
    out = np.asarray(
        ragged_paged_attention(
            q, kv, kv_lens, pages, cu, num_seqs, sm_scale=scale, sliding_window=window, soft_cap=cap
        )
    )
    assert_matches_dense(out, q, kv, pages, cu, seqs, scale, window, cap)


def test_write_kv_interleaves_and_drops_padding():
    pages = jnp.zeros((3, 4, 4, 8))  # 3 pages, 2 kv heads, page_size 4, head_dim 8
    k = jnp.arange(2 * 2 * 8, dtype=jnp.float32).reshape(2, 2, 8) + 1
    v = -k
    out = np.asarray(write_kv(pages, k, v, jnp.asarray([5, 12], jnp.int32)))  # 12 = past the pool
    np.testing.assert_array_equal(out[1, 0::2, 1], np.asarray(k[0]))  # page 1, slot 1
    np.testing.assert_array_equal(out[1, 1::2, 1], np.asarray(v[0]))
    assert np.count_nonzero(out) == np.count_nonzero(np.asarray(k[0])) * 2
    assert list(itertools.chain(out.shape)) == [3, 4, 4, 8]


@pytest.mark.parametrize("mix", ["decode", "mixed"])
def test_decodes_spread_over_several_groups(monkeypatch, mix):
    import pallas_kernels.ragged_paged_attention.reference as reference

    monkeypatch.setattr(reference, "DECODE_GROUP", 2)  # 5 sequences -> 3 decode groups
    rng = np.random.default_rng(3)
    (q, kv, kv_lens, pages, cu), num_seqs, expected, scale = build_case(rng, MIXES[mix](16), 8, 2, 64, 16, 8)
    out = reference.ragged_paged_attention(q, kv, kv_lens, pages, cu, num_seqs, sm_scale=scale)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 20, 130, 10_000])
def test_traced_window_over_long_contexts(window):
    """A window given as a traced value (as a layer scan passes it) over contexts several
    key chunks long, where whole chunks fall before the window and are skipped."""
    rng = np.random.default_rng(2)
    seqs = [(300, 1), (200, 70), (0, 5), (390, 1)]
    (q, kv, kv_lens, pages, cu), num_seqs, _, scale = build_case(rng, seqs, 4, 2, 64, 16, 4)
    run = jax.jit(
        lambda w: ragged_paged_attention(
            q, kv, kv_lens, pages, cu, num_seqs, sm_scale=scale, sliding_window=w
        )
    )
    out = np.asarray(run(jnp.int32(window)))
    assert_matches_dense(out, q, kv, pages, cu, seqs, scale, window)
