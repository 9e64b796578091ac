"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections (none on
the output projection). The port is LlamaForCausalLM with those switches; this file says
how a Qwen2 config sets them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxserve.models.llama import LlamaArgs


def without_unused_window(hf: Mapping) -> dict:
    """Qwen configs name a sliding window even when `use_sliding_window` is off, in which
    case transformers attends over the full context: drop the window then. With it on,
    only some layers use it, which the port does not do yet: refused."""
    hf = dict(hf)
    if hf.get("use_sliding_window", False):
        raise ValueError(
            "Qwen sliding-window attention (use_sliding_window, per-layer windows) is not supported by "
            "jaxserve yet."
        )
    hf.pop("sliding_window", None)
    return hf


def qwen2_args(hf: Mapping, max_model_len: int) -> LlamaArgs:
    args = LlamaArgs.from_hf(without_unused_window(hf), max_model_len)
    return dataclasses.replace(args, qkv_bias=True, o_bias=False)
