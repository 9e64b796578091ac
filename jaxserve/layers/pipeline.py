"""A model's layers run in turn, as one scan, or as stages of a pipeline.

Under pipeline parallelism the mesh has a "stage" axis of size > 1 (sharding.py): the layer
stacks, every per-layer input and the KV pool (which holds each layer's pages in turn) are split
over it, so each stage's devices hold the weights and pages of its own consecutive layers. The
step is still one SPMD program for all devices (one process or several, as tensor parallelism):
a shard_map, manual over "stage" only (tensor parallelism inside a stage splits as everywhere
else), in which stage s runs its layers at tick s, while the others wait, and hands its
activations to stage s + 1 (a collective permute of one [tokens, hidden] array); the last stage's
output is then shared with every stage, which computes the head (a vocabulary-sized projection,
split over "model" as without stages). Inside a stage a layer's index is its index within the
stage: what it reads by index (a 4-bit kernel's stack, its pages, its KV scales) is the stage's.

One batch is in the pipeline at a time, so a stage's devices are idle while the others run:
pipeline parallelism here buys capacity (a model larger than one tensor-parallel group holds),
not speed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

STAGE_AXIS = "stage"


def num_stages() -> int:
    """Pipeline stages of the mesh the step is traced under (1: no pipeline)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.shape.get(STAGE_AXIS, 1)


def run_layers(
    layer: Callable,  # (carry, per-layer inputs, whole, meta, shared) -> (carry, None)
    x: jax.Array,  # [tokens, hidden]
    kv_pool: jax.Array | None,  # layer-major pages (None: a model without a cache)
    per_layer: dict[str, Any],  # arrays [num_layers, ...], each layer's slice handed to `layer`
    whole: Any = None,  # arrays [num_layers, ...] a layer reads whole, at its index
    meta: Any = None,  # AttentionMetadata: its kv_scales [num_layers, 2] are per layer
    shared: Any = None,  # the arrays every layer reads (positions, LoRA masks...)
) -> tuple[jax.Array, jax.Array | None]:
    """(x, kv_pool) after every layer: `layer((x, kv_pool), per_layer_l, whole, meta, shared)`
    for each layer l, with per_layer_l["index"] the layer's index (within its stage under a
    pipeline). `layer` must read traced arrays only from its arguments: one it closed over would
    carry the mesh outside the stages into them, which JAX refuses where it indexes the array."""

    def scan(x, kv_pool, per_layer, whole, meta, shared):  # the layers of this device's stage
        per_layer = {
            **per_layer,
            "index": jnp.arange(jax.tree.leaves(per_layer)[0].shape[0], dtype=jnp.int32),
        }
        return jax.lax.scan(lambda c, xs: layer(c, xs, whole, meta, shared), (x, kv_pool), per_layer)[0]

    stages = num_stages()
    if stages == 1:
        return scan(x, kv_pool, per_layer, whole, meta, shared)
    local_layers = jax.tree.leaves(per_layer)[0].shape[0] // stages

    def stage_body(x, kv_pool, per_layer, whole, meta, shared):
        stage = jax.lax.axis_index(STAGE_AXIS)
        if meta is not None and meta.kv_scales is not None:
            own = jax.lax.dynamic_slice_in_dim(meta.kv_scales, stage * local_layers, local_layers)
            meta = dataclasses.replace(meta, kv_scales=own)

        def run(x, kv_pool):
            return scan(x, kv_pool, per_layer, whole, meta, shared)

        for tick in range(stages):
            x, kv_pool = jax.lax.cond(stage == tick, run, lambda x, kv_pool: (x, kv_pool), x, kv_pool)
            if tick < stages - 1:  # to the next stage; the others get zeros, which they never use
                x = jax.lax.ppermute(x, STAGE_AXIS, [(tick, tick + 1)])
        return jax.lax.psum(jnp.where(stage == stages - 1, x, jnp.zeros_like(x)), STAGE_AXIS), kv_pool

    split, same = PartitionSpec(STAGE_AXIS), PartitionSpec()
    piped = jax.shard_map(
        stage_body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(same, split, split, split, same, same),
        out_specs=(same, split),
        axis_names={STAGE_AXIS},
        check_vma=False,
    )
    return piped(x, kv_pool, per_layer, whole, meta, shared)
