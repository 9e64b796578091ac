"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head of q and k before the
rotary embedding, and a head_dim of its own (not hidden_size / num_heads). The port is
LlamaForCausalLM with those switches; this file says how a Qwen3 config sets them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxserve.models.llama import LlamaArgs
from jaxserve.models.qwen2 import with_layer_windows


def qwen3_args(hf: Mapping, max_model_len: int) -> LlamaArgs:
    return dataclasses.replace(LlamaArgs.from_hf(with_layer_windows(hf), max_model_len), qk_norm=True)
