"""Rotary position embeddings, with the scaling variants Llama-family configs ask for.

Frequencies are computed once on the host from the HF config; inside the jit only the
per-token cos/sin are made. Hugging Face's rotate-half layout is used throughout (GGUF
q/k weights are un-permuted at load to match it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


def rope_parameters(hf_config: Mapping) -> dict:
    """The rope settings of a config in either spelling: transformers 5's `rope_parameters`
    or the older `rope_theta` + `rope_scaling`."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def rope_inv_freq(hf_config: Mapping, head_dim: int, max_model_len: int) -> np.ndarray:  # [head_dim // 2]
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    original_max = int(
        params.get("original_max_position_embeddings") or hf_config.get("max_position_embeddings", 2048)
    )
    if rope_type == "dynamic":
        # vLLM's choice: scale once for the served length, so a token's rotation never depends
        # on what else is in the batch (transformers rescales per forward pass).
        factor = float(params["factor"])
        if max_model_len > original_max:
            base *= ((factor * max_model_len / original_max) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        low_wavelen, high_wavelen = original_max / low, original_max / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(
    x: jax.Array,  # [num_tokens, num_heads, head_dim]
    positions: jax.Array,  # [num_tokens] int32
    inv_freq: jax.Array,  # [head_dim // 2]
) -> jax.Array:  # [num_tokens, num_heads, head_dim]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [num_tokens, head_dim // 2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
