"""RMSNorm as Llama-family models define it: statistics in float32, scale applied after
casting back, so that bfloat16 serving rounds where the reference rounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(
    x: jax.Array,  # [num_tokens, hidden]
    weight: jax.Array,  # [hidden]
    eps: float,
) -> jax.Array:  # [num_tokens, hidden]
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)
