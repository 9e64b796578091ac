"""Qwen3-MoE: the Qwen3 decoder (q/k norms, its own head_dim) with a mixture of experts in
place of every layer's MLP; the top-k routing weights are renormalised only with
`norm_topk_prob`. The port is LlamaForCausalLM with those switches; this file maps the config
and splits the stacked expert tensors transformers can save (`save_original_format=False`)
into the per-expert names of the hub checkpoints."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

import numpy as np

from jaxserve.layers.moe import MoEArgs
from jaxserve.models.llama import LlamaArgs


def moe_llama_args(hf: Mapping, max_model_len: int, moe: MoEArgs) -> LlamaArgs:
    """The Llama decoder with `moe` for every MLP; the experts' activation must be SiLU."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported for MoE models (only 'silu').")
    return dataclasses.replace(LlamaArgs.from_hf(hf, max_model_len), moe=moe)


def qwen3_moe_args(hf: Mapping, max_model_len: int) -> LlamaArgs:
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            "Qwen3-MoE models with dense layers among the sparse ones (mlp_only_layers, "
            "decoder_sparse_step != 1) are not supported by jaxserve yet."
        )
    hf = dict(hf)
    if not hf.get("use_sliding_window", False):  # named even when off; on, every layer is windowed
        hf["sliding_window"] = None
    moe = MoEArgs(
        num_experts=hf.get("num_experts") or hf["num_local_experts"],  # the latter as transformers 5 saves it
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        renormalize=bool(hf.get("norm_topk_prob", False)),
    )
    return dataclasses.replace(moe_llama_args(hf, max_model_len, moe), qk_norm=True)


def split_stacked_experts(name: str, tensor: np.ndarray, args: LlamaArgs) -> Iterator[tuple[str, np.ndarray]]:
    """`mlp.experts.gate_up_proj` [experts, 2 * intermediate, hidden] (gate rows, then up) and
    `mlp.experts.down_proj` [experts, hidden, intermediate] -> one tensor per expert and
    projection; any other tensor unchanged."""
    prefix, _, part = name.rpartition(".mlp.experts.")
    if part == "gate_up_proj":
        gates, ups = np.split(tensor, 2, axis=1)
        for j in range(tensor.shape[0]):
            yield f"{prefix}.mlp.experts.{j}.gate_proj.weight", gates[j]
            yield f"{prefix}.mlp.experts.{j}.up_proj.weight", ups[j]
    elif part == "down_proj":
        for j, down in enumerate(tensor):
            yield f"{prefix}.mlp.experts.{j}.down_proj.weight", down
    else:
        yield name, tensor
