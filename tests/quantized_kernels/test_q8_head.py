"""The native Q8_0 LM head (pallas_kernels/quantized_matmul/cpu.cc Q8Head) against float64 numpy on
the dequantized table, for any number of rows, and where the served head runs it."""

from __future__ import annotations

import ctypes
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers import linear
from pallas_kernels import native
from pallas_kernels.quantized_matmul import q8_head


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert native.load(), "the native CPU kernels did not build (see the log)"


def _table(rng, vocab, hidden):
    values = rng.integers(-127, 128, (vocab, hidden), dtype=np.int8)
    scale = (rng.random((vocab, hidden // 32)) * 0.01).astype(np.float32)
    dense = (values.reshape(vocab, -1, 32) * scale[..., None].astype(np.float64)).reshape(vocab, hidden)
    return values, scale, dense


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 33])
@pytest.mark.parametrize("vocab, hidden", [(300, 32), (1000, 576), (256, 96)])
def test_kernel_matches_the_dequantized_table(rows, vocab, hidden):
    rng = np.random.default_rng(rows * 7 + vocab)
    values, scale, dense = _table(rng, vocab, hidden)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    got = np.asarray(jax.jit(q8_head)(x, values, scale))
    want = x.astype(np.float64) @ dense.T
    # x is multiplied as int16 per group of 32 (relative error ~1e-5 of the group's largest value)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_the_served_head_runs_the_kernel_for_few_rows_and_xla_beyond():
    rng = np.random.default_rng(1)
    values, scale, dense = _table(rng, 2048, 64)
    for rows in (1, linear.HEAD_KERNEL_MAX_ROWS, linear.HEAD_KERNEL_MAX_ROWS + 1):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        text = jax.jit(linear.tied_head).lower(x, values, scale).as_text()
        assert ("jaxserve_q8_head" in text) == (rows <= linear.HEAD_KERNEL_MAX_ROWS)
        got = np.asarray(jax.jit(linear.tied_head)(x, values, scale))
        np.testing.assert_allclose(got, x @ dense.T, rtol=1e-4, atol=1e-4 * np.abs(x @ dense.T).max())


def test_a_float32_table_or_bfloat16_rows_take_the_other_paths():
    rng = np.random.default_rng(2)
    values, scale, dense = _table(rng, 64, 32)
    assert q8_head(jnp.ones((1, 32), jnp.bfloat16), values, scale) is None
    assert q8_head(jnp.ones((1, 32), jnp.float32), dense.astype(np.float32), scale) is None


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86-64 instruction set")
def test_without_avx512_the_portable_loops_compute_the_same(tmp_path):
    compiler = native._compiler()
    path = str(tmp_path / "portable.so")
    native._build(
        compiler, path, tuple(f for f in native.FLAGS if f != "-march=native") + ("-march=x86-64-v3",)
    )
    handler = jax.ffi.pycapsule(ctypes.CDLL(path).JaxserveQ8Head)
    jax.ffi.register_ffi_target("jaxserve_q8_head_portable", handler, platform="cpu")
    rng = np.random.default_rng(5)
    values, scale, dense = _table(rng, 500, 64)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    call = jax.ffi.ffi_call("jaxserve_q8_head_portable", jax.ShapeDtypeStruct((6, 500), jnp.float32))
    got = np.asarray(jax.jit(call)(x, values, scale))
    np.testing.assert_allclose(got, np.asarray(jax.jit(q8_head)(x, values, scale)), rtol=2e-6, atol=2e-5)


def test_bad_shapes_are_an_error_not_a_crash():
    call = jax.ffi.ffi_call("jaxserve_q8_head", jax.ShapeDtypeStruct((1, 8), jnp.float32))
    with pytest.raises(Exception, match="q8_head"):
        np.asarray(
            jax.jit(call)(
                np.ones((1, 40), np.float32), np.ones((8, 40), np.int8), np.ones((8, 1), np.float32)
            )
        )
