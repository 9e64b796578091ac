"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections (none on
the output projection), and optionally sliding windows on the upper layers. The port is
LlamaForCausalLM with those switches; this file says how a Qwen2 config sets them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxserve.models.llama import LlamaArgs


def with_layer_windows(hf: Mapping) -> dict:
    """Qwen configs name a sliding window even when `use_sliding_window` is off, in which
    case every layer attends over the full context. With it on, the layers from
    `max_window_layers` up are windowed (spelled out as `layer_types` in newer configs)."""
    hf = dict(hf)
    if not hf.get("use_sliding_window", False):
        hf["sliding_window"] = None
    elif not hf.get("layer_types"):
        n = hf["num_hidden_layers"]
        first = hf.get("max_window_layers", n)
        hf["layer_types"] = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return hf


def qwen2_args(hf: Mapping, max_model_len: int) -> LlamaArgs:
    args = LlamaArgs.from_hf(with_layer_windows(hf), max_model_len)
    return dataclasses.replace(args, qkv_bias=True, o_bias=False)
