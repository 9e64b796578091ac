"""The native CPU attention kernel (pallas_kernels/ragged_paged_attention/cpu.cc) against dense
numpy attention, on the batches every implementation is checked on, and the dispatch that picks
it: few float32 rows on one CPU device run the kernel, everything else the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_kernels.attention_cases import F32_TOL, MIXES, PADDED_LAYOUT, build_case

from pallas_kernels import native
from pallas_kernels.ragged_paged_attention import cpu, reference


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert native.load(), "the native CPU kernels did not build (see the log)"


def _case(rng, seqs, group=3, head_dim=64, page_size=16, max_num_seqs=8, num_tokens=cpu.CPU_KERNEL_MAX_ROWS):
    layout = {**PADDED_LAYOUT, "num_tokens": num_tokens}  # rows past the sequences: padding
    return build_case(
        rng, seqs, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
        max_num_seqs=max_num_seqs, **layout,
    )  # fmt: skip


def _run(case, **kw):
    fn = jax.jit(functools.partial(cpu.ragged_paged_attention, sm_scale=case.sm_scale, **kw))
    text = fn.lower(*case.args).as_text()
    assert "jaxserve_ragged_paged_attention" in text  # the kernel ran, not the reference
    return np.asarray(fn(*case.args))


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [16, 32])
def test_decodes_match_dense(group, head_dim, page_size):
    rng = np.random.default_rng(group * 100 + head_dim + page_size)
    case = _case(rng, MIXES["decode"](page_size), group, head_dim, page_size)
    np.testing.assert_allclose(_run(case), case.expected(), **F32_TOL)


def test_a_few_prefill_rows_and_padding_rows():
    """Chunks of several rows attend causally; padding rows (NaN here) come out zero."""
    rng = np.random.default_rng(7)
    case = build_case(
        rng, [(40, 3), (0, 5), (17, 1)], num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=16,
        max_num_seqs=4, num_tokens=12, nan_padding=True, write_new_kv=True,
    )  # fmt: skip
    out = _run(case)
    np.testing.assert_allclose(out[:9], case.expected()[:9], **F32_TOL)
    assert np.all(out[9:] == 0.0)


@pytest.mark.parametrize("window, cap", [(7, None), (None, 5.0), (20, 2.0), (10**6, None)])
def test_sliding_window_and_soft_cap(window, cap):
    rng = np.random.default_rng(1)
    case = _case(rng, [(40, 1), (3, 2), (25, 4)])
    np.testing.assert_allclose(
        _run(case, sliding_window=window, soft_cap=cap), case.expected(window, cap), **F32_TOL
    )


@pytest.mark.parametrize("window, cap", [(None, None), (7, None), (30, 2.0)])
def test_sequences_of_many_rows(window, cap):
    """A chunk of 21 rows at context, a verify step's 4 rows, and a prompt of 9 from position 0:
    each row sees only its own causal (and windowed) keys."""
    rng = np.random.default_rng(11)
    case = _case(rng, [(37, 21), (50, 4), (0, 9), (12, 1)])
    np.testing.assert_allclose(
        _run(case, sliding_window=window, soft_cap=cap), case.expected(window, cap), **F32_TOL
    )


def test_traced_window_as_a_model_scanning_layers_passes_it():
    rng = np.random.default_rng(2)
    case = _case(rng, [(60, 1), (33, 1)])

    def per_layer(window):
        return cpu.ragged_paged_attention(*case.args, sm_scale=case.sm_scale, sliding_window=window)

    outs = jax.jit(lambda w: jax.lax.map(per_layer, w))(jnp.asarray([9, 2**30], jnp.int32))
    np.testing.assert_allclose(np.asarray(outs[0]), case.expected(9), **F32_TOL)
    np.testing.assert_allclose(np.asarray(outs[1]), case.expected(), **F32_TOL)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_quantized_pages_match_dense(dtype):
    """int8 and fp8 pages (a quantized KV pool): the kernel casts the stored values, the scales go
    into q and the output, decodes and a chunk alike."""
    rng = np.random.default_rng(5)
    case = _case(rng, [(40, 1), (3, 2), (25, 4), (0, 9)]).quantized(dtype, 0.02, 0.03)
    assert cpu.kernel_applies(case.q, case.kv)
    fn = jax.jit(
        functools.partial(cpu.ragged_paged_attention, sm_scale=case.sm_scale, k_scale=0.02, v_scale=0.03)
    )
    assert "jaxserve_ragged_paged_attention" in fn.lower(*case.args).as_text()
    np.testing.assert_allclose(np.asarray(fn(*case.args)), case.expected(), **F32_TOL)


def test_what_runs_the_reference():
    """Many rows and bfloat16 rows or pages are the reference's (same values either way)."""
    rng = np.random.default_rng(3)
    many = _case(rng, [(5, 20)], num_tokens=cpu.CPU_KERNEL_MAX_ROWS + 8)
    half = _case(rng, [(5, 1)])
    half = type(half)(
        **{**half.__dict__, "q": half.q.astype(jnp.bfloat16), "kv": half.kv.astype(jnp.bfloat16)}
    )
    for case in (many, half):
        assert not cpu.kernel_applies(case.q, case.kv)
    assert not cpu.kernel_applies(half.q.astype(jnp.float32), half.kv)
    assert cpu.kernel_applies(half.q.astype(jnp.float32), half.kv.astype(jnp.float32))
    out = jax.jit(functools.partial(cpu.ragged_paged_attention, sm_scale=many.sm_scale))(*many.args)
    np.testing.assert_allclose(np.asarray(out), many.expected(), **F32_TOL)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_pages_are_written_in_place_as_the_reference_writes_them(dtype):
    """The native write (fp8 pages: XLA:CPU would copy the pool around its own) stores exactly the
    reference's bytes, drops padding tokens' rows, and writes into the pool's own buffer when the
    pool is donated, as a layer scan carries it."""
    rng = np.random.default_rng(7)
    pages, heads, page_size, head_dim = 9, 2, 8, 64
    pool = jnp.asarray(rng.standard_normal((pages, 2 * heads, page_size, head_dim)) * 0.1, dtype)
    k, v = (jnp.asarray(rng.standard_normal((6, heads, head_dim)), jnp.float32) for _ in "kv")
    slots = jnp.asarray([3, 17, 18, 40, 71, pages * page_size], jnp.int32)  # the last: padding
    want = np.asarray(reference.write_kv(pool, k, v, slots, 0.05, 0.07)).view(np.uint8)
    write = jax.jit(cpu.write_kv, donate_argnums=0)
    assert "jaxserve_write_rows" in write.lower(pool, k, v, slots, 0.05, 0.07).as_text()
    before = np.asarray(pool).view(np.uint8).copy()
    where = pool.unsafe_buffer_pointer()
    got = write(pool, k, v, slots, 0.05, 0.07)
    assert np.array_equal(np.asarray(got).view(np.uint8), want)
    assert not np.array_equal(want, before)  # rows were written
    assert got.unsafe_buffer_pointer() == where  # in place
