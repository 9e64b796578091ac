"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder with fused projections in its checkpoints
(`qkv_proj` holds q, k and v stacked by rows; `gate_up_proj` holds gate then up), in the
4k models a sliding window, in the long-context ones LongRoPE, in some partial rotary
(all three handled by the shared decoder and rotary.py). The port is LlamaForCausalLM;
this file splits the fused tensors into the Llama names at load."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from jaxserve.models.llama import LlamaArgs


def split_fused(name: str, tensor: np.ndarray, args: LlamaArgs) -> Iterator[tuple[str, np.ndarray]]:
    """One checkpoint tensor -> the Llama-named tensors it holds (itself if not fused)."""
    prefix, _, rest = name.rpartition(".self_attn.qkv_proj.")
    if prefix:
        q = args.num_heads * args.head_dim
        k, v = np.split(tensor[q:], 2, axis=0)  # as many rows each, however many KV heads
        yield f"{prefix}.self_attn.q_proj.{rest}", tensor[:q]
        yield f"{prefix}.self_attn.k_proj.{rest}", k
        yield f"{prefix}.self_attn.v_proj.{rest}", v
        return
    prefix, _, rest = name.rpartition(".mlp.gate_up_proj.")
    if prefix:
        gate, up = np.split(tensor, 2, axis=0)
        yield f"{prefix}.mlp.gate_proj.{rest}", gate
        yield f"{prefix}.mlp.up_proj.{rest}", up
        return
    yield name, tensor
