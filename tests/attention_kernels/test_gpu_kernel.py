"""The GPU (Triton) kernel in Pallas' interpret mode against dense attention and the
reference, over GQA ratios, head dims, page sizes, decode / prefill / mixed batches,
padded sequence slots, sliding windows (Python int and traced), soft cap, float32 and
bfloat16; and the kernels lowered to Triton IR for a CUDA target (no GPU needed).

Compilation dominates the cost here (a few seconds per configuration, running is
milliseconds), so every configuration is compiled once (`_jit`) and runs all the batches
that share its shapes: `PADDED_LAYOUT` pads every batch to the same array sizes."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_kernels.attention_cases import (
    F32_TOL,
    MIXES,
    PADDED_LAYOUT,
    QUANTIZED,
    AttentionCase,
    build_case,
)

from pallas_kernels.ragged_paged_attention import gpu, reference

# float32: F32_TOL, kernel and dense attention both accumulate in float32, in a different
# order: they agree to ~2e-6 on these unit-variance inputs, as the reference does.
# bfloat16: both sides read the same bfloat16 inputs, but the kernel feeds the
# probabilities to the second matmul in bfloat16 (relative error 2^-9 per weight, a few
# 1e-3 on the output after averaging) where the reference stays in float32, and both
# round their float32 results to bfloat16 (8-bit mantissa), so an output that falls near
# a rounding boundary may differ by one unit in the last place: 2^-7 relative (2^-6 =
# 0.016 for outputs in [2, 4), the largest here; measured: at most one such unit, mean
# ~1e-4). rtol 1e-2 covers that unit at any magnitude, atol 1e-2 the matmul rounding.
BF16_TOL = dict(atol=1e-2, rtol=1e-2)


@functools.cache
def _jit(impl, traced_window: bool = False, **opts):
    """One compiled function per implementation and static options; the window, when
    traced, is a trailing argument (as a layer scan passes it)."""
    if traced_window:
        return jax.jit(lambda *a: impl(*a[:-1], sliding_window=a[-1], **opts))
    return jax.jit(lambda *a: impl(*a, **opts))


def _kernel(args, window=None, **opts):
    args = args if window is None else (*args, jnp.int32(window))
    out = _jit(gpu.ragged_paged_attention, window is not None, interpret=True, **opts)(*args)
    return np.asarray(out.astype(jnp.float32))


def _reference(args, window=None, **opts):
    args = args if window is None else (*args, jnp.int32(window))
    out = _jit(reference.ragged_paged_attention, window is not None, **opts)(*args)
    return np.asarray(out.astype(jnp.float32))


def _case(
    seqs, group, head_dim, page_size, *, num_kv_heads=2, max_num_seqs=8, seed=0, dtype=None
) -> AttentionCase:
    """A float32 batch (its queries and pool cast to `dtype` when given)."""
    case = build_case(
        np.random.default_rng(seed),
        seqs,
        num_q_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        **PADDED_LAYOUT,
    )
    if dtype is not None:
        case = dataclasses.replace(case, q=case.q.astype(dtype), kv=case.kv.astype(dtype))
    return case


# GQA ratios 1, 2, 4, 8 x head_dim 64, 128 x page size 16, 32, pairwise: every pair of
# values meets in some case (8 compilations rather than 16). Each mix holds the lengths
# 1, page-1, page, page+1 and several pages (as contexts of decodes, as prompts, or mixed
# with chunked prefills): 5 sequences in 8 slots, then padding rows.
@pytest.mark.parametrize(
    "group, head_dim, page_size",
    [
        (1, 64, 32),
        (1, 128, 16),
        (2, 64, 16),
        (2, 128, 32),
        (4, 64, 32),
        (4, 128, 16),
        (8, 64, 16),
        (8, 128, 32),
    ],
)
def test_matches_dense_attention(group, head_dim, page_size):
    for mix in sorted(MIXES):
        case = _case(MIXES[mix](page_size), group, head_dim, page_size, seed=group + head_dim)
        out = _kernel(case.args, sm_scale=case.sm_scale)
        np.testing.assert_allclose(out, case.expected(), **F32_TOL, err_msg=mix)
        assert np.all(out[case.num_rows :] == 0.0), mix  # padding rows


@pytest.mark.parametrize(
    "group, head_dim, page_size",
    [(3, 64, 16), (6, 80, 32)],  # 9 q / 3 kv heads (SmolLM2); a head_dim padded to 128
)
def test_group_and_head_dim_padding(group, head_dim, page_size):
    for mix in ["decode", "mixed"]:
        case = _case(MIXES[mix](page_size), group, head_dim, page_size, seed=group)
        out = _kernel(case.args, sm_scale=case.sm_scale)
        np.testing.assert_allclose(out, case.expected(), **F32_TOL, err_msg=mix)
        assert np.all(out[case.num_rows :] == 0.0), mix


# Contexts of several key blocks and decode splits, so windows start mid-split and whole
# splits fall before them.
LONG = [(300, 1), (200, 70), (0, 5), (390, 1), (47, 1), (0, 33)]


@pytest.mark.parametrize("window, cap", [(7, None), (40, 2.0)])
def test_sliding_window_and_soft_cap(window, cap):
    case = _case(LONG, 2, 64, 16, seed=1)
    out = _kernel(case.args, sm_scale=case.sm_scale, sliding_window=window, soft_cap=cap)
    np.testing.assert_allclose(out, case.expected(window, cap), **F32_TOL)
    assert np.all(out[case.num_rows :] == 0.0)


def test_traced_window_matches_the_reference():
    """One compilation serves every window; huge values mean full attention."""
    case = _case(LONG, 4, 64, 16, seed=2)
    for window in [1, 20, 64, 130, 10_000, 2**31 - 1]:
        out = _kernel(case.args, window=window, sm_scale=case.sm_scale)
        want = _reference(case.args, window=window, sm_scale=case.sm_scale)
        np.testing.assert_allclose(out, want, **F32_TOL, err_msg=f"window {window}")


@pytest.mark.parametrize(
    "group, head_dim, page_size, window, cap",
    [(4, 128, 16, None, None), (1, 64, 32, 24, 10.0)],
)
def test_bfloat16_matches_the_reference(group, head_dim, page_size, window, cap):
    seqs = LONG if window else MIXES["mixed"](page_size)
    case = _case(seqs, group, head_dim, page_size, seed=3, dtype=jnp.bfloat16)
    opts = dict(sm_scale=case.sm_scale, sliding_window=window, soft_cap=cap)
    out = _kernel(case.args, **opts)
    np.testing.assert_allclose(out, _reference(case.args, **opts), **BF16_TOL)
    assert np.all(out[case.num_rows :] == 0.0)


@pytest.mark.parametrize(
    "tiles",
    [
        dict(num_kv_splits=1),  # no split: one program walks the whole context
        dict(num_kv_splits=8, block_k=16, prefill_block_m=16),  # many splits and steps, 2-token q blocks
    ],
)
def test_tile_sizes_and_splits(tiles):
    case = _case(LONG, 8, 64, 16, seed=4)
    out = _kernel(case.args, sm_scale=case.sm_scale, **tiles)
    np.testing.assert_allclose(out, case.expected(), **F32_TOL)
    assert np.all(out[case.num_rows :] == 0.0)


def test_auto_splits():
    assert gpu._auto_splits(1, 8, 4096, 64) == 16  # one long decode: fill the SMs
    assert gpu._auto_splits(256, 8, 4096, 64) == 1  # a full batch fills them already
    assert gpu._auto_splits(8, 2, 128, 64) == 2  # never more splits than the context has key blocks


def test_stale_slots_and_empty_batch():
    """Slots past num_seqs may hold stale lengths, page tables and query offsets from an
    earlier step: they must change nothing. With no sequences every row is zero."""
    case = _case(MIXES["mixed"](16), 2, 64, 16, seed=5)
    q, kv, kv_lens, pages, cu, num_seqs = case.args
    n = len(case.seqs)
    stale = (
        q,
        kv,
        kv_lens.at[n:].set(jnp.asarray([200, 1, 7])),
        pages.at[n:].set(pages[:3]),
        cu.at[n + 1 :].set(jnp.asarray([7, 3, 400])),
    )
    out = _kernel((*stale, num_seqs), sm_scale=case.sm_scale)
    np.testing.assert_allclose(out, case.expected(), **F32_TOL)
    assert np.all(out[case.num_rows :] == 0.0)
    assert np.all(_kernel((*stale, jnp.zeros(1, jnp.int32)), sm_scale=case.sm_scale) == 0.0)


@pytest.mark.parametrize("dtype, k_scale, v_scale", QUANTIZED)
def test_quantized_pages(dtype, k_scale, v_scale):
    """int8 and fp8 pages with their scales, as the engine's quantized KV cache holds them."""
    for mix in ["decode", "mixed"]:
        case = _case(MIXES[mix](16), 4, 64, 16, seed=6).quantized(dtype, k_scale, v_scale)
        out = _kernel(case.args, sm_scale=case.sm_scale, **case.scales)
        np.testing.assert_allclose(out, case.expected(), **F32_TOL, err_msg=mix)
        assert np.all(out[case.num_rows :] == 0.0), mix


def test_bfloat16_queries_over_int8_pages():
    """A bfloat16 model over int8 pages: the products run in bfloat16, as with bfloat16 pages."""
    case = _case(LONG, 2, 64, 16, seed=7, dtype=jnp.bfloat16).quantized("int8", 0.03, 0.05)
    opts = dict(sm_scale=case.sm_scale, **case.scales)
    np.testing.assert_allclose(_kernel(case.args, **opts), _reference(case.args, **opts), **BF16_TOL)


@pytest.mark.parametrize(
    "group, head_dim, window, cap, pages",
    [(4, 128, None, None, None), (3, 80, 100, 30.0, None), (4, 128, None, None, "float8_e4m3fn")],
)
def test_lowers_to_triton(monkeypatch, group, head_dim, window, cap, pages):
    """Both launches lower through the Triton backend for a CUDA target (every primitive
    has a Triton lowering, every in-kernel array has power-of-two dimensions) and the
    resulting Triton modules verify. This is no compile to PTX: that needs a GPU."""
    from jax._src.pallas.triton import lowering

    modules = []
    lower = lowering.lower_jaxpr_to_triton_module

    def lower_and_keep(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module)
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_keep)
    case = _case(MIXES["mixed"](16), group, head_dim, 16, dtype=jnp.bfloat16)
    if pages is not None:
        case = case.quantized(pages, 0.02, 0.5)
    scale = case.sm_scale
    fn = (
        lambda *a: gpu.ragged_paged_attention(  # noqa: E731
            *a[:-1], sm_scale=scale, sliding_window=a[-1], soft_cap=cap, **case.scales
        )
    )
    window = None if window is None else jnp.int32(window)
    triton_call = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    try:
        jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton_call])(*case.args, window)
    except RuntimeError as e:  # newer jaxlibs compile to PTX while lowering: not without a GPU
        if "compilation handler" not in str(e):
            raise
    assert len(modules) == 2
    for module in modules:
        assert module.operation.verify()
        text = str(module)
        assert text.count("tt.dot") == 2 and "scf.for" in text  # the key loop: pipelined by Triton
