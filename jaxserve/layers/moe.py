"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks top_k experts per token, each
expert is a SiLU-gated MLP, and the token's output is the routing-weighted sum of its experts'.

Tokens are not run through every expert: the (token, expert) pairs are sorted by expert and
each expert's matmuls run over its own rows only, as one grouped matmul (`jax.lax.ragged_dot`,
group sizes = rows per expert). The results are put back in pair order and combined.

With expert parallelism the experts are split over a mesh axis (sharding.py names it): every
device routes all tokens, runs only the pairs whose expert it holds, and the partial outputs
are summed over the axis. Without it, the experts' weights are split like a dense MLP's.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxserve.sharding import logical_to_spec


@dataclass(frozen=True)
class MoEArgs:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each expert
    renormalize: bool  # rescale the top_k routing weights to sum to 1 (Qwen3-MoE's norm_topk_prob)
    expert_parallel: bool = False  # experts split over devices (--enable-expert-parallel)


def route(
    x: jax.Array,  # [num_tokens, hidden]
    router: jax.Array,  # [hidden, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[jax.Array, jax.Array]:  # (weights [num_tokens, top_k] float32, experts [num_tokens, top_k] int32)
    """Softmax over the router logits in float32, then the top_k experts and their weights."""
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)  # [num_tokens, num_experts]
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts


def grouped_experts(
    x: jax.Array,  # [num_tokens, hidden]
    weights: jax.Array,  # [num_tokens, top_k] float32
    experts: jax.Array,  # [num_tokens, top_k] int32, index into the experts given here
    gate: jax.Array,  # [num_experts, hidden, intermediate]
    up: jax.Array,  # [num_experts, hidden, intermediate]
    down: jax.Array,  # [num_experts, intermediate, hidden]
    scales: tuple[jax.Array, jax.Array, jax.Array] | None = None,  # quantized: gate's, up's, down's
) -> jax.Array:  # [num_tokens, hidden] float32
    """The routed experts' outputs, weighted and summed per token in float32. Pairs whose
    expert index is outside [0, num_experts) (held by another device) contribute nothing.
    Quantized expert weights (layers/linear.py) come with per-channel `scales` [num_experts,
    out], applied to each row's result with its own expert's scale."""
    num_tokens, top_k = experts.shape
    num_experts = gate.shape[0]
    pair_expert = experts.reshape(-1)  # [num_pairs]
    held = (pair_expert >= 0) & (pair_expert < num_experts)
    key = jnp.where(held, pair_expert, num_experts)  # pairs not held sort last, in no group
    order = jnp.argsort(key, stable=True)  # [num_pairs] pair indices grouped by expert
    group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)

    row_expert = jnp.minimum(key[order], num_experts - 1)  # [num_pairs] (rows not held: dropped below)
    gate_s, up_s, down_s = (None, None, None) if scales is None else scales

    def per_expert(lhs, w, scale):  # each group of rows times its own expert's weight
        if scale is None:
            return jax.lax.ragged_dot(lhs, w, group_sizes)
        y = jax.lax.ragged_dot(lhs, w.astype(lhs.dtype), group_sizes, preferred_element_type=jnp.float32)
        return (y * scale[row_expert]).astype(lhs.dtype)

    rows = x[order // top_k]  # [num_pairs, hidden]
    h = jax.nn.silu(per_expert(rows, gate, gate_s)) * per_expert(rows, up, up_s)  # [num_pairs, intermediate]
    y = per_expert(h, down, down_s)  # [num_pairs, hidden], sorted
    y = jnp.where(held[order][:, None], y, 0)
    y = jnp.zeros_like(y).at[order].set(y, unique_indices=True)  # back to pair order
    y = y.reshape(num_tokens, top_k, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", y, weights)


def moe_mlp(
    x: jax.Array,  # [num_tokens, hidden]
    router: jax.Array,  # [hidden, num_experts]
    gate: jax.Array,  # [num_experts, hidden, intermediate]
    up: jax.Array,  # [num_experts, hidden, intermediate]
    down: jax.Array,  # [num_experts, intermediate, hidden]
    args: MoEArgs,
    scales: tuple[jax.Array, jax.Array, jax.Array] | None = None,  # of quantized experts
) -> jax.Array:  # [num_tokens, hidden]
    def local(x, router, experts, scales, first_expert=0):
        weights, chosen = route(x, router, args.top_k, args.renormalize)
        return grouped_experts(x, weights, chosen - first_expert, *experts, scales)

    axis = logical_to_spec(("experts",), expert_parallel=args.expert_parallel)[0]
    mesh = jax.sharding.get_abstract_mesh()  # the mesh the step is traced under, if any
    if axis is None or mesh.empty or mesh.shape.get(axis, 1) == 1:
        return local(x, router, (gate, up, down), scales).astype(x.dtype)

    def shard(x, router, experts, scales):  # experts, scales: this device's experts'
        partial = local(x, router, experts, scales, jax.lax.axis_index(axis) * experts[0].shape[0])
        return jax.lax.psum(partial, axis)

    split, whole = PartitionSpec(axis), PartitionSpec()
    # x and the router whole, the experts (and their scales) split
    specs = (whole, whole, (split,) * 3, None if scales is None else (split,) * 3)
    sharded = jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=whole)
    return sharded(x, router, (gate, up, down), scales).astype(x.dtype)
