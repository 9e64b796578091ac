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

# The scaling types implemented here, and the keys each needs from a config's rope settings.
ROPE_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
    "longrope": ("long_factor", "short_factor"),
}
SUPPORTED_ROPE_TYPES = tuple(ROPE_REQUIRED_KEYS)


def rope_parameters(hf_config: Mapping, layer_type: str = "full_attention") -> dict:
    """The rope settings of a config in either spelling: transformers 5's `rope_parameters`
    or the older `rope_theta` + `rope_scaling`. Configs whose layer types rotate differently
    (Gemma 3) nest one such dict per layer type; `layer_type` picks one."""
    params = dict(hf_config.get("rope_parameters") or {})
    if isinstance(params.get(layer_type), Mapping):
        params = dict(params[layer_type])
    scaling = hf_config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if hf_config.get(key) is not None:
            params.setdefault(key, hf_config[key])
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = "longrope" if rope_type == "su" else rope_type  # early Phi-3 configs say "su"
    if rope_type == "mrope":  # (older Qwen2-VL configs: default frequencies, in sections)
        params["rope_type"] = "default"
    return params


def mrope_rows(hf_config: Mapping) -> tuple[int, ...]:
    """M-RoPE (Qwen2-VL): which of a token's three positions (time, height, width) each rotary
    frequency turns by, from `mrope_section`; () for a one-position rope."""
    section = rope_parameters(hf_config).get("mrope_section") or ()
    return tuple(i % 3 for i, n in enumerate(section) for _ in range(n))


def _original_max(params: Mapping, hf_config: Mapping) -> int:
    return int(
        params.get("original_max_position_embeddings") or hf_config.get("max_position_embeddings", 2048)
    )


def max_len_with_rope_scaling(hf_config: Mapping) -> tuple[int, str]:
    """The longest context the model supports, and where that number comes from. As vLLM
    does: linear, dynamic and YaRN scaling stretch the trained length by their factor (YaRN
    from its original length); llama3-style configs already state the stretched length."""
    max_pos = int(hf_config.get("max_position_embeddings") or hf_config.get("n_positions") or 2048)
    params = rope_parameters(hf_config)
    kind = params["rope_type"]
    if kind in ("linear", "dynamic", "yarn") and params.get("factor"):
        base = max_pos
        if kind == "yarn" and params.get("original_max_position_embeddings"):
            base = int(params["original_max_position_embeddings"])
        return int(base * float(params["factor"])), f"max_position_embeddings with {kind} rope factor"
    return max_pos, "max_position_embeddings"


def rope_inv_freq(
    hf_config: Mapping, head_dim: int, max_model_len: int, layer_type: str = "full_attention"
) -> np.ndarray:  # [head_dim // 2]
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))  # the rotated leading dims
    original_max = _original_max(params, hf_config)
    if rope_type == "dynamic":
        # vLLM's choice: scale once for the served length, so a token's rotation never depends
        # on what else is in the batch (transformers rescales per forward pass).
        factor = float(params["factor"])
        if max_model_len > original_max:
            base *= ((factor * max_model_len / original_max) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if rope_type == "longrope":
        # vLLM's choice again: the long factors whenever the served length passes the trained
        # one (transformers switches per forward pass, on the length of the sequence).
        long = max_model_len > original_max
        factors = np.asarray(params["long_factor" if long else "short_factor"], np.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"longrope factors have {factors.size} entries, the rotary needs {inv_freq.size}."
            )
        inv_freq = inv_freq / factors
    elif rope_type == "linear":
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
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, params, hf_config, dim, base, original_max)
    return inv_freq.astype(np.float32)


def _yarn_factor(params: Mapping, hf_config: Mapping, original_max: int) -> float:
    factor = params.get("factor")
    return float(factor) if factor is not None else hf_config["max_position_embeddings"] / original_max


def _yarn_inv_freq(
    inv_freq: np.ndarray, params: Mapping, hf_config: Mapping, dim: int, base: float, original_max: int
) -> np.ndarray:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, and blend
    linearly over the dimensions between beta_fast and beta_slow rotations."""
    factor = _yarn_factor(params, hf_config, original_max)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_scaling(hf_config: Mapping) -> float:
    """The factor YaRN and LongRoPE apply to cos and sin (so to q.k twice); 1 for every other type."""
    params = rope_parameters(hf_config)
    if params["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original_max = _original_max(params, hf_config)
    if params["rope_type"] == "longrope":
        factor = float(
            params.get("factor") or hf_config.get("max_position_embeddings", original_max) / original_max
        )
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    factor = _yarn_factor(params, hf_config, original_max)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    return mscale(factor)


def apply_rope(
    x: jax.Array,  # [num_tokens, num_heads, head_dim]
    positions: jax.Array,  # [num_tokens] int32, or [num_tokens, rotary_dim // 2]: a position per frequency
    inv_freq: jax.Array,  # [rotary_dim // 2]: the first rotary_dim dims rotate (partial rotary)
    scaling: float = 1.0,  # rope_attention_scaling
) -> jax.Array:  # [num_tokens, num_heads, head_dim]
    rotary_dim = 2 * inv_freq.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rope(x[..., :rotary_dim], positions, inv_freq, scaling)
        return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)
    positions = positions.astype(jnp.float32)
    angles = (positions[:, None] if positions.ndim == 1 else positions) * inv_freq[None, :]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
