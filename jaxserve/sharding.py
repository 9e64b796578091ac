"""The one table that maps logical axis names onto mesh axes.

Models, the loader and the KV cache name their array axes logically ("vocab", "embed",
"q_heads", ...); only this module knows that tensor parallelism means splitting some of
them over the mesh axis "model", pipeline parallelism splits the layers (and the KV pool's pages,
which are layer-major) over the axis "stage", and data parallelism uses the axis "data". Changing
how a model is sharded is a change to this table, never to a model file (layers/pipeline.py runs
each stage's layers on its own devices).

Mixture-of-experts weights split over "model" either within each expert (its intermediate axis,
like a dense MLP) or, with expert parallelism, by whole experts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "stage", "model")

LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "layers": "stage",
    "vocab": "model",
    "embed": None,
    "q_heads": "model",  # flattened num_heads * head_dim of q projections
    "kv_heads": "model",  # flattened num_kv_heads * head_dim of k/v projections
    "mlp": "model",
    "experts": None,  # the experts of an MoE layer
    "expert_mlp": "model",  # each expert's intermediate axis
    "norm": None,
    "labels": None,  # a classifier's classes
    "kv_pages": "stage",  # the pool holds each layer's pages in turn: a stage's layers' pages
    "kv_page_slots": None,
    "kv_combined_heads": "model",  # the interleaved (k, v) head axis of the KV pool
    "head_dim": None,
    "lora_rank": "model",  # a LoRA factor's rank, split only with --fully-sharded-loras
    "vision_heads": "model",  # a vision encoder's flattened heads (models/idefics3.py)
    "vision_mlp": "model",  # its MLP's intermediate axis
}

# --enable-expert-parallel: whole experts per device instead of a slice of every expert.
EXPERT_PARALLEL_RULES = {**LOGICAL_AXIS_RULES, "experts": "model", "expert_mlp": None}


def logical_to_spec(axes: Sequence[str | None], expert_parallel: bool = False) -> PartitionSpec:
    rules = EXPERT_PARALLEL_RULES if expert_parallel else LOGICAL_AXIS_RULES
    return PartitionSpec(*(rules.get(a) if a else None for a in axes))


def make_mesh(
    tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None, pipeline_parallel_size: int = 1
) -> Mesh:
    """data x stage x model over the first devices: a stage's tensor-parallel group is consecutive
    devices (on several hosts, one host's devices hold whole stages where they can)."""
    devices = jax.devices() if devices is None else devices
    need = tensor_parallel_size * data_parallel_size * pipeline_parallel_size
    if need > len(devices):
        raise ValueError(
            f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = {need} needs "
            f"{need} devices; {len(devices)} are visible."
        )
    grid = np.asarray(devices[:need]).reshape(
        data_parallel_size, pipeline_parallel_size, tensor_parallel_size
    )
    tpu = getattr(grid.flat[0], "platform", "") == "tpu"
    if pipeline_parallel_size > 1 and tpu and jax.config.jax_use_shardy_partitioner:
        # A stage's steps run a shard_map over "model" (attention's, by a device's heads) inside the
        # stages' shard_map, manual over "stage" only. XLA's SPMD partitioner aborts the process on
        # that nesting when it comes through Shardy (JAX's default) for TPU ("Check failed:
        # target.IsManualSubgroup() == sharding().IsManualSubgroup()"), and through GSPMD for CPU
        # ("Check failed: !IsManualLeaf()"): each platform takes the partitioner that compiles it.
        logger.info("Pipeline parallel on TPU: partitioning with GSPMD (jax_use_shardy_partitioner off).")
        jax.config.update("jax_use_shardy_partitioner", False)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_for(parallel, devices=None) -> Mesh:
    """The mesh of one engine replica of a ParallelConfig: its stages and tensor-parallel groups."""
    return make_mesh(
        parallel.tensor_parallel_size, devices=devices, pipeline_parallel_size=parallel.pipeline_parallel_size
    )


def named_sharding(mesh: Mesh, axes: Sequence[str | None], expert_parallel: bool = False) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, expert_parallel))


def state_shardings(state: nnx.State, mesh: Mesh, expert_parallel: bool = False):
    """A pytree of NamedShardings matching `state`, from each Param's logical_axes."""

    def one(var):
        axes = var.get_metadata().get("logical_axes") or (None,) * var.value.ndim
        return named_sharding(mesh, axes, expert_parallel)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def per_device_bytes(tree) -> int:
    """Bytes of the arrays in `tree` (concrete or abstract) on the fullest device (every device holds one shard of each)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total
