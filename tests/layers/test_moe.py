"""The mixture-of-experts block (grouped matmul over experts sorted by token) against a dense
reference that runs every expert on every token and masks by the routing; and expert
parallelism on an 8-device CPU mesh against the unsplit block."""

from __future__ import annotations

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import run_on_fake_devices

from jaxserve.layers.moe import MoEArgs, moe_mlp, route

HIDDEN, INTERMEDIATE, NUM_TOKENS = 32, 48, 37


def make_inputs(num_experts: int, seed: int = 0):
    """Random weights where the last expert is never routed to (a constant feature of every
    token meets a large negative router weight), so one group is empty."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(NUM_TOKENS, HIDDEN)).astype(np.float32)
    router = rng.normal(size=(HIDDEN, num_experts)).astype(np.float32)
    x[:, 0], router[0, -1] = 3.0, -20.0
    gate, up = (0.2 * rng.normal(size=(2, num_experts, HIDDEN, INTERMEDIATE))).astype(np.float32)
    down = (0.2 * rng.normal(size=(num_experts, INTERMEDIATE, HIDDEN))).astype(np.float32)
    return x, router, gate, up, down


@functools.partial(jax.jit, static_argnums=(5, 6))
def dense_moe(x, router, gate, up, down, top_k: int, renormalize: bool) -> jax.Array:
    """Every expert on every token; the routing keeps the top_k weights of each token."""
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)  # [tokens, experts]
    kth = jnp.sort(probs, axis=-1)[:, -top_k][:, None]
    weights = jnp.where(probs >= kth, probs, 0.0)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    h = jax.nn.silu(jnp.einsum("th,ehi->eti", x, gate)) * jnp.einsum("th,ehi->eti", x, up)
    y = jnp.einsum("eti,eih->eth", h, down)  # [experts, tokens, hidden]
    return jnp.einsum("eth,te->th", y, weights)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "raw_weights"])
def test_grouped_experts_match_dense_reference(renormalize):
    num_experts, top_k = 6, 2
    x, router, gate, up, down = make_inputs(num_experts)
    _, experts = route(x, router, top_k, renormalize)
    counts = np.bincount(np.asarray(experts).ravel(), minlength=num_experts)
    assert counts[-1] == 0 and len(set(counts[:-1].tolist())) > 1, counts  # an empty group, unequal others
    args = MoEArgs(num_experts, top_k, INTERMEDIATE, renormalize)
    out = jax.jit(moe_mlp, static_argnums=5)(x, router, gate, up, down, args)
    np.testing.assert_allclose(out, dense_moe(x, router, gate, up, down, top_k, renormalize), atol=1e-5)


EXPERT_PARALLEL_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np
    from jax.sharding import PartitionSpec
    from layers.test_moe import HIDDEN as H, INTERMEDIATE as I, dense_moe, make_inputs
    from jaxserve.layers.moe import MoEArgs, moe_mlp
    from jaxserve.sharding import make_mesh, named_sharding

    assert len(jax.devices()) == 8
    num_experts, top_k = 8, 2
    x, router, *experts = make_inputs(num_experts)
    want = dense_moe(x, router, *experts, top_k, True)
    axes = [("experts", "embed", "expert_mlp")] * 2 + [("experts", "expert_mlp", "embed")]
    for tp, ep in ((4, True), (8, True), (4, False)):
        mesh = make_mesh(tp)
        weights = [jax.device_put(w, named_sharding(mesh, a, ep)) for w, a in zip(experts, axes)]
        shard_shapes = {s.data.shape for w in weights for s in w.addressable_shards}
        if ep:  # whole experts per device
            assert weights[0].sharding.spec == PartitionSpec("model", None, None), weights[0].sharding
            assert shard_shapes == {(num_experts // tp, H, I), (num_experts // tp, I, H)}, shard_shapes
        else:  # a slice of every expert's intermediate axis
            assert shard_shapes == {(num_experts, H, I // tp), (num_experts, I // tp, H)}, shard_shapes
        args = MoEArgs(num_experts, top_k, I, True, expert_parallel=ep)
        step = jax.jit(lambda x, r, g, u, d: moe_mlp(x, r, g, u, d, args))
        with jax.set_mesh(mesh):
            assert ("shard_map" in str(jax.make_jaxpr(step)(x, router, *weights))) == ep
            out = step(x, router, *weights)
        np.testing.assert_allclose(out, want, atol=1e-5)
    print("ok")
    """
)


def test_expert_parallel_matches_unsplit_on_8_devices():
    """A fresh process: the device count is fixed when JAX starts, and this one has 1 device."""
    out = run_on_fake_devices(EXPERT_PARALLEL_SCRIPT, timeout=300)
    assert out.strip().endswith("ok")
