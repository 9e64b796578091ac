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
from attention_kernels.attention_cases import F32_TOL, MIXES, PADDED_LAYOUT, QUANTIZED, build_case

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention, write_kv


def _case(rng, seqs, num_q_heads, num_kv_heads, head_dim, page_size, max_num_seqs):
    return build_case(
        rng,
        seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        **PADDED_LAYOUT,
    )


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_reference_matches_dense(group, head_dim, page_size, mix):
    rng = np.random.default_rng(group * 1000 + head_dim + page_size)
    seqs = MIXES[mix](page_size)
    num_kv_heads = 2
    case = _case(rng, seqs, num_kv_heads * group, num_kv_heads, head_dim, page_size, max_num_seqs=8)
    out = _jitted_reference(case.sm_scale)(*case.args)
    np.testing.assert_allclose(np.asarray(out), case.expected(), **F32_TOL)


@functools.cache
def _jitted_reference(sm_scale):
    """One jitted reference per scale: the three mixes of a configuration share its shapes,
    so they share one compilation."""
    return jax.jit(functools.partial(ragged_paged_attention, sm_scale=sm_scale))


def test_padding_rows_are_zero():
    rng = np.random.default_rng(0)
    case = _case(rng, [(3, 2), (0, 4)], 4, 2, 64, 16, 4)
    out = np.asarray(ragged_paged_attention(*case.args, sm_scale=case.sm_scale))
    assert np.all(out[6:] == 0.0) and out.shape[0] > 6
    assert np.all(np.abs(out[:6]).sum(axis=(1, 2)) > 0)


@pytest.mark.parametrize("num_tokens", [1, 2, 3])
def test_buckets_of_a_few_rows(num_tokens):
    """The smallest token buckets (a batch-1 decode step's is one row) trace and attend."""
    rng = np.random.default_rng(1)
    seqs = [(20, 1)] if num_tokens == 1 else [(20, 1), (0, num_tokens - 1)]
    case = build_case(
        rng, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_num_seqs=4,
        num_tokens=num_tokens, write_new_kv=True,
    )  # fmt: skip
    out = np.asarray(ragged_paged_attention(*case.args, sm_scale=case.sm_scale))
    np.testing.assert_allclose(out, case.expected(), **F32_TOL)


@pytest.mark.parametrize("window, cap", [(7, None), (None, 5.0), (20, 2.0)])
def test_sliding_window_and_soft_cap(window, cap):
    rng = np.random.default_rng(1)
    seqs = [(40, 1), (0, 50), (25, 9)]
    case = _case(rng, seqs, 4, 2, 64, 16, 4)
    out = np.asarray(
        ragged_paged_attention(*case.args, sm_scale=case.sm_scale, sliding_window=window, soft_cap=cap)
    )
    np.testing.assert_allclose(out, case.expected(window, cap), **F32_TOL)


def test_write_kv_interleaves_and_drops_padding():
    pages = jnp.zeros((3, 4, 4, 8))  # 3 pages, 2 kv heads, page_size 4, head_dim 8
    k = jnp.arange(2 * 2 * 8, dtype=jnp.float32).reshape(2, 2, 8) + 1
    v = -k
    out = np.asarray(write_kv(pages, k, v, jnp.asarray([5, 12], jnp.int32)))  # 12 = past the pool
    np.testing.assert_array_equal(out[1, 0::2, 1], np.asarray(k[0]))  # page 1, slot 1
    np.testing.assert_array_equal(out[1, 1::2, 1], np.asarray(v[0]))
    assert np.count_nonzero(out) == np.count_nonzero(np.asarray(k[0])) * 2
    assert list(itertools.chain(out.shape)) == [3, 4, 4, 8]


@pytest.mark.parametrize("mix", ["prefill", "mixed", "short prompts"])
def test_prefill_blocks_reordered_over_several_steps(monkeypatch, mix):
    """Small blocks and steps: full blocks and tail blocks of many sequences, with and without
    cached context, sorted by the key chunks they need and handled a few per loop step."""
    import pallas_kernels.ragged_paged_attention.reference as reference

    monkeypatch.setattr(reference, "BLOCK_Q", 16)
    monkeypatch.setattr(reference, "TAIL_BLOCK_Q", 4)
    monkeypatch.setattr(reference, "ROWS_PER_STEP", 32)  # 2 full blocks or 8 tail blocks a step
    seqs = {
        "short prompts": [(0, 37), (50, 19), (0, 2), (200, 70), (3, 1), (0, 130), (17, 33), (0, 16)],
    }.get(mix) or MIXES[mix](16)
    rng = np.random.default_rng(4)
    case = _case(rng, seqs, 8, 2, 64, 16, 8)
    out = reference.ragged_paged_attention(*case.args, sm_scale=case.sm_scale)
    np.testing.assert_allclose(np.asarray(out), case.expected(), **F32_TOL)


@pytest.mark.parametrize("mix", ["decode", "mixed"])
def test_decodes_spread_over_several_groups(monkeypatch, mix):
    import pallas_kernels.ragged_paged_attention.reference as reference

    monkeypatch.setattr(reference, "DECODE_GROUP", 2)  # 5 sequences -> 3 decode groups
    rng = np.random.default_rng(3)
    case = _case(rng, MIXES[mix](16), 8, 2, 64, 16, 8)
    out = reference.ragged_paged_attention(*case.args, sm_scale=case.sm_scale)
    np.testing.assert_allclose(np.asarray(out), case.expected(), **F32_TOL)


@pytest.mark.parametrize("window", [1, 20, 130, 10_000])
def test_traced_window_over_long_contexts(window):
    """A window given as a traced value (as a layer scan passes it) over contexts several
    key chunks long, where whole chunks fall before the window and are skipped."""
    rng = np.random.default_rng(2)
    seqs = [(300, 1), (200, 70), (0, 5), (390, 1)]
    case = _case(rng, seqs, 4, 2, 64, 16, 4)
    run = jax.jit(lambda w: ragged_paged_attention(*case.args, sm_scale=case.sm_scale, sliding_window=w))
    out = np.asarray(run(jnp.int32(window)))
    np.testing.assert_allclose(out, case.expected(window), **F32_TOL)


@pytest.mark.parametrize("dtype, k_scale, v_scale", QUANTIZED)
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("cap", [None, 5.0])
def test_quantized_pages_attend_as_their_scaled_values(dtype, k_scale, v_scale, mix, cap):
    rng = np.random.default_rng(4)
    case = _case(rng, MIXES[mix](16), 4, 2, 64, 16, 8).quantized(dtype, k_scale, v_scale)
    run = _jit(soft_cap=cap)
    out = np.asarray(run(*case.args, case.sm_scale, case.k_scale, case.v_scale))
    np.testing.assert_allclose(out, case.expected(soft_cap=cap), **F32_TOL)


@functools.cache
def _jit(soft_cap):
    return jax.jit(
        lambda *a: ragged_paged_attention(
            *a[:6], sm_scale=a[6], soft_cap=soft_cap, k_scale=a[7], v_scale=a[8]
        ),
        static_argnums=6,
    )


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_write_kv_quantizes_and_saturates(dtype):
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((6, 2, 8)).astype(np.float32)
    v = 3 * rng.standard_normal((6, 2, 8)).astype(np.float32)
    k[0, 0, 0], v[1, 1, 1] = 1e6, -1e6  # far past any format's range
    k_scale, v_scale = 0.04, 0.1
    slots = jnp.arange(6, dtype=jnp.int32)
    pages = write_kv(jnp.zeros((3, 4, 4, 8), dtype), jnp.asarray(k), jnp.asarray(v), slots, k_scale, v_scale)
    stored = np.asarray(pages, np.float64).transpose(0, 2, 1, 3).reshape(12, 2, 2, 8)[:6]
    got_k, got_v = stored[:, :, 0] * k_scale, stored[:, :, 1] * v_scale
    largest = 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
    assert np.all(np.isfinite(stored))
    assert got_k[0, 0, 0] == pytest.approx(largest * k_scale) and got_v[1, 1, 1] == pytest.approx(
        -largest * v_scale
    )
    fine = np.ones(k.shape, bool)
    fine[0, 0, 0] = fine[1, 1, 1] = False  # (the saturated ones)
    for got, want, scale in ((got_k, k, k_scale), (got_v, v, v_scale)):
        err, want = np.abs(got - want)[fine], np.abs(want)[fine]
        if dtype == jnp.int8:  # rounded to whole steps of the scale: within half a step
            np.testing.assert_array_less(err, scale / 2 + 1e-7)
        else:  # rounded to the mantissa: half a unit in the last place, or the subnormal step
            rel = 2.0 ** -(jnp.finfo(dtype).nmant + 1)
            np.testing.assert_array_less(err, rel * want + float(jnp.finfo(dtype).smallest_subnormal) * scale)
