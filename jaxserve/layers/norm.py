"""RMSNorm as Llama-family models define it: statistics in float32, scale applied after
casting back, so that bfloat16 serving rounds where the reference rounds. Gemma's variant
scales by (1 + weight) in float32 and casts last; `offset` selects it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(
    x: jax.Array,  # [num_tokens, hidden]
    weight: jax.Array,  # [hidden]
    eps: float,
    offset: float = 0.0,
) -> jax.Array:  # [num_tokens, hidden]
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (xf * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)
