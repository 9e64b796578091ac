"""The native 4-bit matmul (pallas_kernels/quantized_matmul/cpu.cc) against its jnp reference and
against float64 numpy on the dequantized weights, and where each runs."""

from __future__ import annotations

import ctypes
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native
from pallas_kernels.quantized_matmul import cpu_kernel_applies, q4_matmul, q4_matmuls, tile
from pallas_kernels.quantized_matmul.reference import q4_matmul_reference


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert native.load(), "the native CPU kernels did not build (see the log)"


def _stack(rng, layers, k, n, tiled=True):
    packed = rng.integers(0, 256, (layers, k // 2, n), dtype=np.uint8)
    scale = (rng.random((layers, k // 64, 2, n)) * 0.02).astype(np.float32)
    mins = (-rng.random((layers, k // 64, 2, n)) * 0.1).astype(np.float32)
    return tile(packed, scale, mins) if tiled else (packed, scale, mins)


def _dense(packed, scale, mins, layer, parts=False):
    """The layer's weights [k, n] in float64, unpacked the documented way (from tiles, if tiled);
    with `parts`, their two terms q * scale and min apart."""
    q, s, m = packed[layer].astype(np.float64), scale[layer], mins[layer]
    if q.ndim == 3:  # tiles [n / 64, k / 2, 64]: put the columns back side by side
        q, s, m = (np.concatenate(list(a), axis=-1) for a in (q, s, m))
    k2, n = q.shape
    lo, hi = q % 16, q // 16  # byte row 32b + i: input 64b + i (low), 64b + 32 + i (high)
    groups = np.stack([lo.reshape(-1, 32, n), hi.reshape(-1, 32, n)], axis=1)  # [k / 64, 2, 32, n]
    scaled, offset = groups * s[:, :, None], np.broadcast_to(m[:, :, None], groups.shape)
    if parts:
        return scaled.reshape(2 * k2, n), offset.reshape(2 * k2, n)
    return (scaled + offset).reshape(2 * k2, n)


def _int16_rows(x):
    """x as the kernel multiplies it by q * scale: per group of 32, int16 values times a scale
    (max |x| / 32767), rounded in float32 as the kernel rounds them. (The mins multiply x's exact sum.)"""
    groups = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(groups).max(-1, keepdims=True)
    inv = np.float32(32767) / np.where(amax > 0, amax, np.float32(1))
    q = np.rint(groups * np.where(amax > 0, inv, np.float32(0)))
    return (q.astype(np.float64) * (amax / np.float32(32767)).astype(np.float64)).reshape(x.shape)


def _ffi(x, packed, scale, mins, layer):
    """The kernel alone, for any row count."""
    out = jax.ShapeDtypeStruct((x.shape[0], packed.shape[1] * packed.shape[-1]), jnp.float32)
    return jax.ffi.ffi_call("jaxserve_q4_matmul", [out])(x, jnp.int32(layer), packed, scale, mins)[0]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11, 16, 37])
@pytest.mark.parametrize("k, n", [(64, 64), (576, 192), (1536, 576)])
def test_kernel_matches_dense_and_reference(rows, k, n):
    """Exactly the documented integer arithmetic (x in int16 per group), and within float32 matmul
    tolerance of the float64 product and of the reference (which takes either layout)."""
    rng = np.random.default_rng(rows * 7 + k + n)
    packed, scale, mins = _stack(rng, 3, k, n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, :32] = 0  # a group of zeros: no scale to divide by
    got = np.asarray(jax.jit(_ffi, static_argnums=4)(x, packed, scale, mins, 2))
    scaled, offset = _dense(packed, scale, mins, 2, parts=True)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(got, _int16_rows(x) @ scaled + x64 @ offset, rtol=2e-6, atol=2e-5)
    want = x64 @ (scaled + offset)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    ref = np.asarray(jax.jit(q4_matmul_reference)(x, packed, scale, mins, jnp.int32(2)))
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-4)
    untiled = _stack(np.random.default_rng(rows * 7 + k + n), 3, k, n, tiled=False)
    np.testing.assert_allclose(
        np.asarray(jax.jit(q4_matmul_reference)(x, *untiled, jnp.int32(2))), ref, rtol=1e-6
    )


def test_dispatch_runs_the_kernel_for_few_rows_inside_a_layer_scan():
    """As a model runs it: the layer index traced, the stacks whole; each layer's product right."""
    rng = np.random.default_rng(0)
    packed, scale, mins = _stack(rng, 4, 128, 128)
    x = rng.standard_normal((4, 128)).astype(np.float32)

    def layers(x):
        return jax.lax.map(lambda i: q4_matmul(x, packed, scale, mins, i), jnp.arange(4, dtype=jnp.int32))

    assert "jaxserve_q4_matmul" in jax.jit(layers).lower(x).as_text()
    got = np.asarray(jax.jit(layers)(x))
    for layer in range(4):
        want = x.astype(np.float64) @ _dense(packed, scale, mins, layer)
        np.testing.assert_allclose(got[layer], want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 3])
def test_projections_of_one_input_in_one_call(rows):
    """q, k, v (or gate, up) of different widths read the same x in one call; each output right."""
    rng = np.random.default_rng(rows)
    stacks = [_stack(rng, 2, 576, n) for n in (576, 192, 64)]
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    fn = jax.jit(lambda x: q4_matmuls(x, [tuple(map(jnp.asarray, s)) for s in stacks], jnp.int32(1)))
    assert fn.lower(x).as_text().count("jaxserve_q4_matmul") == 1
    for got, stack in zip(fn(x), stacks, strict=True):
        np.testing.assert_allclose(
            np.asarray(got), x.astype(np.float64) @ _dense(*stack, 1), rtol=1e-4, atol=1e-3
        )


def test_other_dtypes_and_untiled_stacks_run_the_reference():
    rng = np.random.default_rng(1)
    tiled, untiled = _stack(rng, 1, 64, 64), _stack(rng, 1, 64, 64, tiled=False)
    x = rng.standard_normal((300, 64)).astype(np.float32)
    assert cpu_kernel_applies(jnp.asarray(x), tiled[0])  # rows: any number
    assert not cpu_kernel_applies(jnp.asarray(x, jnp.bfloat16), tiled[0])
    assert not cpu_kernel_applies(jnp.asarray(x), untiled[0])
    stacks = [jnp.asarray(a) for a in untiled]
    text = jax.jit(lambda x: q4_matmul(x, *stacks, jnp.int32(0))).lower(x).as_text()
    assert "jaxserve_q4_matmul" not in text


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86-64 instruction set")
def test_without_avx512_the_portable_loops_compute_the_same(tmp_path):
    """The kernel built for a CPU without AVX-512 VNNI (its plain loops) gives the same values."""
    compiler = native._compiler()
    path = str(tmp_path / "portable.so")
    native._build(
        compiler, path, tuple(f for f in native.FLAGS if f != "-march=native") + ("-march=x86-64-v3",)
    )
    handler = jax.ffi.pycapsule(ctypes.CDLL(path).JaxserveQ4Matmul)
    jax.ffi.register_ffi_target("jaxserve_q4_matmul_portable", handler, platform="cpu")
    rng = np.random.default_rng(5)
    packed, scale, mins = _stack(rng, 2, 576, 192)
    x = rng.standard_normal((5, 576)).astype(np.float32)
    out = jax.ShapeDtypeStruct((5, 192), jnp.float32)
    call = jax.ffi.ffi_call("jaxserve_q4_matmul_portable", [out])
    got = np.asarray(jax.jit(lambda x: call(x, jnp.int32(1), packed, scale, mins)[0])(x))
    np.testing.assert_allclose(
        got, np.asarray(jax.jit(_ffi, static_argnums=4)(x, packed, scale, mins, 1)), rtol=2e-6, atol=2e-5
    )
    scaled, offset = _dense(packed, scale, mins, 1, parts=True)
    np.testing.assert_allclose(
        got, _int16_rows(x) @ scaled + x.astype(np.float64) @ offset, rtol=2e-6, atol=2e-5
    )


def test_bad_shapes_are_an_error_not_a_crash():
    rng = np.random.default_rng(2)
    packed, scale, mins = _stack(rng, 2, 64, 64)
    x = np.ones((1, 64), np.float32)
    with pytest.raises(Exception, match="layer out of range"):
        np.asarray(jax.jit(_ffi, static_argnums=4)(x, packed, scale, mins, 5))


def test_layer_weights_hand_a_kernel_its_stacks_whole_and_slice_the_rest():
    from jaxserve.layers.linear import LayerWeights

    rng = np.random.default_rng(3)
    packed, scale, mins = (jnp.asarray(a) for a in _stack(rng, 3, 64, 64))
    stacked = {"q_proj": packed, "q_proj_scale": scale, "q_proj_min": mins, "input_norm": jnp.ones((3, 64))}
    sliced, whole = LayerWeights.split(stacked)
    assert set(whole) == {"q_proj", "q_proj_scale", "q_proj_min"} and set(sliced) == {"input_norm"}
    w = LayerWeights({k: v[1] for k, v in sliced.items()}, whole, jnp.int32(1))
    assert w.stack("q_proj") is packed and "q_proj_min" in w and "k_proj" not in w and len(w) == 4
    for name, value in stacked.items():  # every name reads as layer 1's slice
        np.testing.assert_array_equal(np.asarray(w[name]), np.asarray(value[1]))


def test_without_a_compiler_the_references_run(monkeypatch, caplog):
    """A machine with no C++ compiler gets one warning and the jnp path, with the same values."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_compiler", lambda: None)
    assert not native.load() and not native.loaded()
    assert "no C++ compiler" in caplog.text
    rng = np.random.default_rng(4)
    stacks = [jnp.asarray(a) for a in _stack(rng, 1, 64, 64)]
    x = rng.standard_normal((1, 64)).astype(np.float32)
    fn = jax.jit(lambda x: q4_matmul(x, *stacks, jnp.int32(0)))
    assert "jaxserve_q4_matmul" not in fn.lower(x).as_text()
    want = x.astype(np.float64) @ _dense(*(np.asarray(a) for a in stacks), 0)
    np.testing.assert_allclose(np.asarray(fn(x)), want, rtol=1e-5, atol=1e-4)
