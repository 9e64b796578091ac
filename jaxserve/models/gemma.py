"""Gemma, Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's switches on.

All three scale the embeddings by sqrt(hidden_size), normalise with (1 + weight) in
float32, use tanh-approximated GELU and tie the output head to the embeddings. Gemma 2
adds norms on the attention and MLP outputs, a softmax scale from
`query_pre_attn_scalar`, soft caps on attention scores and final logits, and windowed
layers alternating with full ones. Gemma 3 adds RMSNorm on q and k, windows on five
layers of every six, and a rope base of its own for the windowed layers. The port is
LlamaForCausalLM; this file says how each config sets the switches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxserve.layers.rotary import rope_attention_scaling, rope_inv_freq, rope_parameters
from jaxserve.models.llama import LlamaArgs


def _common(hf: Mapping) -> dict:
    hf = dict(hf)
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma models with use_bidirectional_attention are not supported by jaxserve.")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    # The first Gemma releases said "gelu" but were trained with the tanh approximation
    # (transformers and vLLM both switch it).
    hf["hidden_act"] = "gelu_pytorch_tanh" if act == "gelu" else act
    hf.setdefault("tie_word_embeddings", True)
    return hf


def _with_layer_types(hf: dict, every: int) -> dict:
    """Older configs say only that one layer in `every` is full-attention, the last of each group."""
    if not hf.get("layer_types"):
        hf["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(hf["num_hidden_layers"])
        ]
    return hf


def gemma_args(hf: Mapping, max_model_len: int) -> LlamaArgs:
    hf = _common(hf)
    args = LlamaArgs.from_hf(hf, max_model_len)
    return dataclasses.replace(args, norm_offset=1.0, embed_scale=hf["hidden_size"] ** 0.5)


def _sandwich(args: LlamaArgs, hf: Mapping, attn_cap: float | None, final_cap: float | None) -> LlamaArgs:
    return dataclasses.replace(
        args,
        sandwich_norms=True,
        attn_scale=float(hf.get("query_pre_attn_scalar") or args.head_dim) ** -0.5,
        attn_soft_cap=hf.get("attn_logit_softcapping", attn_cap),
        final_soft_cap=hf.get("final_logit_softcapping", final_cap),
    )


def gemma2_args(hf: Mapping, max_model_len: int) -> LlamaArgs:
    hf = _with_layer_types(_common(hf), every=2)
    # transformers' defaults for configs that leave the caps out
    return _sandwich(gemma_args(hf, max_model_len), hf, attn_cap=50.0, final_cap=30.0)


def gemma3_args(hf: Mapping, max_model_len: int) -> LlamaArgs:
    hf = _with_layer_types(_common(hf), every=int(hf.get("sliding_window_pattern") or 6))
    nested = hf.get("rope_parameters") or {}
    if "full_attention" not in nested:  # older spelling: rope_theta (+ rope_scaling) and rope_local_base_freq
        hf.setdefault("rope_theta", 1_000_000.0)
        local = {"rope_type": "default", "rope_theta": float(hf.get("rope_local_base_freq") or 10_000.0)}
        hf["rope_parameters"] = {"full_attention": rope_parameters(hf), "sliding_attention": local}
    for layer_type in ("full_attention", "sliding_attention"):
        if rope_attention_scaling({"rope_parameters": hf["rope_parameters"][layer_type]}) != 1.0:
            raise ValueError("Gemma 3 with YaRN rope scaling is not supported by jaxserve.")
    args = gemma_args(hf, max_model_len)
    local_freq = rope_inv_freq(hf, args.head_dim, max_model_len, "sliding_attention")
    args = dataclasses.replace(args, qk_norm=True, local_inv_freq=tuple(local_freq.tolist()))
    return _sandwich(args, hf, attn_cap=None, final_cap=None)
