"""Projections: x @ kernel (+ bias), with the kernel either in the model's dtype or quantized.

Weight-only quantization (`--quantization int8` or `fp8`) stores a projection kernel
[..., in, out] as int8 (or float8 e4m3) values and one float32 scale per output channel,
symmetric: kernel ~= values * scale. The values are cast to the activations' dtype inside the
jitted step and the scale is applied to the matmul's result, so the dequantized kernel exists
only as XLA chooses to (fused into the dot or a per-layer temporary), never in memory between
steps. Only the decoder layers' projections are quantized; embeddings, the LM head, routers,
norms and biases keep the model's dtype, as in vLLM's weight-only schemes.

A quantized kernel `q_proj` comes with a `q_proj_scale` parameter beside it (logical axes: the
kernel's without the input axis, so tensor parallelism shards the scales with their channels).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# --quantization -> (stored dtype, largest magnitude it holds)
WEIGHT_QUANTIZATIONS: dict[str, tuple[np.dtype, float]] = {
    "int8": (np.dtype(jnp.int8), 127.0),
    "fp8": (np.dtype(jnp.float8_e4m3fn), 448.0),
}
SCALE_SUFFIX = "_scale"


def kernel_params(
    rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype, quantization: str | None
) -> dict[str, nnx.Param]:
    """A projection kernel [..., in, out]'s parameters, by name suffix: {"": kernel} in `dtype`,
    or, quantized, {"": values, "_scale": [..., out] float32}. Random values for `dummy` loads
    (their dequantized spread is about the float init's 0.02)."""
    if quantization is None:
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
        return {"": nnx.Param(value, logical_axes=axes)}
    stored, qmax = WEIGHT_QUANTIZATIONS[quantization]
    unit = jax.random.normal(rngs.params(), shape, jnp.float32)  # values of ~qmax/4 spread
    values = jnp.clip(unit * qmax / 4, -qmax, qmax)
    values = (jnp.round(values) if quantization == "int8" else values).astype(stored)
    scale = jnp.full(shape[:-2] + shape[-1:], 0.08 / qmax, jnp.float32)
    return {
        "": nnx.Param(values, logical_axes=axes),
        SCALE_SUFFIX: nnx.Param(scale, logical_axes=axes[:-2] + axes[-1:]),
    }


def linear(x: jax.Array, w: Mapping[str, jax.Array], name: str) -> jax.Array:
    """x @ w[name_proj] (+ w[name_bias]); a quantized kernel is dequantized in the matmul."""
    kernel = w[f"{name}_proj"]
    scale = w.get(f"{name}_proj{SCALE_SUFFIX}")
    if scale is None:
        y = x @ kernel
    else:
        y = (jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32) * scale).astype(x.dtype)
    bias = w.get(f"{name}_bias")
    return y if bias is None else y + bias


def quantize_kernel(kernel: np.ndarray, quantization: str) -> tuple[np.ndarray, np.ndarray]:
    """Host-side: a float kernel [..., in, out] -> (values, scale [..., out] float32), symmetric,
    one scale per output channel (its largest magnitude maps to the dtype's). Works one leading
    index at a time, so a stacked model never needs a second float copy of a whole tensor."""
    stored, qmax = WEIGHT_QUANTIZATIONS[quantization]
    values = np.empty(kernel.shape, stored)
    scale = np.empty(kernel.shape[:-2] + kernel.shape[-1:], np.float32)
    for index in np.ndindex(kernel.shape[:-2]):
        w = np.asarray(kernel[index], np.float32)
        amax = np.abs(w).max(axis=0)
        s = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
        v = w / s
        values[index] = np.clip(np.rint(v), -qmax, qmax) if quantization == "int8" else v
        scale[index] = s
    return values, scale
