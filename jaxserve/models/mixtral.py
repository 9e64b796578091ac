"""Mixtral: the Mistral decoder with a mixture of experts in place of every layer's MLP (top-k
routing weights always renormalised). The port is LlamaForCausalLM with those switches; this
file maps the config and renames Mixtral's checkpoint tensors (`block_sparse_moe.gate`,
`block_sparse_moe.experts.{j}.w1|w3|w2` for gate, up, down) to the names Qwen3-MoE uses,
which the weight map knows."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from jaxserve.layers.moe import MoEArgs
from jaxserve.models.llama import LlamaArgs
from jaxserve.models.qwen3_moe import moe_llama_args, split_stacked_experts

_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def mixtral_args(hf: Mapping, max_model_len: int) -> LlamaArgs:
    moe = MoEArgs(
        num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["intermediate_size"],
        renormalize=True,
    )
    return moe_llama_args(hf, max_model_len, moe)


def rename_experts(name: str, tensor: np.ndarray, args: LlamaArgs) -> Iterator[tuple[str, np.ndarray]]:
    """One Mixtral checkpoint tensor -> the tensors the weight map knows."""
    prefix, _, rest = name.rpartition(".block_sparse_moe.")
    if prefix:
        parts = rest.split(".")  # gate.weight, or experts.{j}.w1.weight
        if parts[0] == "experts" and len(parts) == 4:
            parts[2] = _EXPERT_PROJ.get(parts[2], parts[2])
        name = f"{prefix}.mlp.{'.'.join(parts)}"
    yield from split_stacked_experts(name, tensor, args)
