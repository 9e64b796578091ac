"""The native 4-bit matmul (pallas_kernels/quantized_matmul/cpu.cc) against its jnp reference and
against float64 numpy on the dequantized weights, and where each runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native
from pallas_kernels.quantized_matmul import CPU_KERNEL_MAX_ROWS, cpu_kernel_applies, q4_matmul, q4_matmuls
from pallas_kernels.quantized_matmul.reference import q4_matmul_reference


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert native.load(), "the native CPU kernels did not build (see the log)"


def _stack(rng, layers, k, n):
    packed = rng.integers(0, 256, (layers, k // 2, n), dtype=np.uint8)
    scale = (rng.random((layers, k // 64, 2, n)) * 0.02).astype(np.float32)
    mins = (-rng.random((layers, k // 64, 2, n)) * 0.1).astype(np.float32)
    return packed, scale, mins


def _dense(packed, scale, mins, layer):
    """The layer's weights [k, n] in float64, unpacked the documented way."""
    q, s, m = packed[layer].astype(np.float64), scale[layer], mins[layer]
    k2, n = q.shape
    lo, hi = q % 16, q // 16  # byte row 32b + i: input 64b + i (low), 64b + 32 + i (high)
    groups = np.stack([lo.reshape(-1, 32, n), hi.reshape(-1, 32, n)], axis=1)  # [k / 64, 2, 32, n]
    w = groups * s[:, :, None] + m[:, :, None]
    return w.reshape(2 * k2, n)


def _ffi(x, packed, scale, mins, layer):
    """The kernel alone, for any row count."""
    out = jax.ShapeDtypeStruct((x.shape[0], packed.shape[-1]), jnp.float32)
    return jax.ffi.ffi_call("jaxserve_q4_matmul", [out])(x, jnp.int32(layer), packed, scale, mins)[0]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11, 16])
@pytest.mark.parametrize("k, n", [(64, 64), (576, 192), (1536, 576)])
def test_kernel_matches_dense_and_reference(rows, k, n):
    rng = np.random.default_rng(rows * 7 + k + n)
    packed, scale, mins = _stack(rng, 3, k, n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = np.asarray(jax.jit(_ffi, static_argnums=4)(x, packed, scale, mins, 2))
    want = x.astype(np.float64) @ _dense(packed, scale, mins, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    ref = np.asarray(jax.jit(q4_matmul_reference)(x, packed, scale, mins, jnp.int32(2)))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_dispatch_runs_the_kernel_for_few_rows_inside_a_layer_scan():
    """As a model runs it: the layer index traced, the stacks whole; each layer's product right."""
    rng = np.random.default_rng(0)
    packed, scale, mins = _stack(rng, 4, 128, 128)
    x = rng.standard_normal((CPU_KERNEL_MAX_ROWS, 128)).astype(np.float32)

    def layers(x):
        return jax.lax.map(lambda i: q4_matmul(x, packed, scale, mins, i), jnp.arange(4, dtype=jnp.int32))

    assert "jaxserve_q4_matmul" in jax.jit(layers).lower(x).as_text()
    got = np.asarray(jax.jit(layers)(x))
    for layer in range(4):
        want = x.astype(np.float64) @ _dense(packed, scale, mins, layer)
        np.testing.assert_allclose(got[layer], want, rtol=1e-5, atol=1e-4)


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
            np.asarray(got), x.astype(np.float64) @ _dense(*stack, 1), rtol=1e-5, atol=1e-4
        )


def test_more_rows_and_other_dtypes_run_the_reference():
    rng = np.random.default_rng(1)
    packed, scale, mins = _stack(rng, 1, 64, 64)
    many = rng.standard_normal((CPU_KERNEL_MAX_ROWS + 1, 64)).astype(np.float32)
    assert not cpu_kernel_applies(jnp.asarray(many))
    assert not cpu_kernel_applies(jnp.asarray(many[:1], jnp.bfloat16))
    assert cpu_kernel_applies(jnp.asarray(many[:1]))
    stacks = [jnp.asarray(a) for a in (packed, scale, mins)]
    text = jax.jit(lambda x: q4_matmul(x, *stacks, jnp.int32(0))).lower(many).as_text()
    assert "jaxserve_q4_matmul" not in text


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
