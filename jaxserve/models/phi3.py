"""Phi-3: the Llama decoder with fused projections in its checkpoints (`qkv_proj` holds q,
k and v stacked by rows; `gate_up_proj` holds gate then up) and, in the 4k models, a
sliding window. The port is LlamaForCausalLM; this file maps the config and splits the
fused tensors into the Llama names at load."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from jaxserve.models.llama import LlamaArgs


def phi3_args(hf: Mapping, max_model_len: int) -> LlamaArgs:
    params = hf.get("rope_parameters") or {}
    if float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("Phi-3 models with partial_rotary_factor < 1 are not supported by jaxserve yet.")
    return LlamaArgs.from_hf(hf, max_model_len)


def split_fused(name: str, tensor: np.ndarray, args: LlamaArgs) -> Iterator[tuple[str, np.ndarray]]:
    """One checkpoint tensor -> the Llama-named tensors it holds (itself if not fused)."""
    prefix, _, rest = name.rpartition(".self_attn.qkv_proj.")
    if prefix:
        q = args.num_heads * args.head_dim
        kv = args.num_kv_heads * args.head_dim
        for part, rows in (
            ("q_proj", slice(0, q)),
            ("k_proj", slice(q, q + kv)),
            ("v_proj", slice(q + kv, None)),
        ):
            yield f"{prefix}.self_attn.{part}.{rest}", tensor[rows]
        return
    prefix, _, rest = name.rpartition(".mlp.gate_up_proj.")
    if prefix:
        gate, up = np.split(tensor, 2, axis=0)
        yield f"{prefix}.mlp.gate_proj.{rest}", gate
        yield f"{prefix}.mlp.up_proj.{rest}", up
        return
    yield name, tensor
