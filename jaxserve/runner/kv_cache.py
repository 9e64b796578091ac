"""The paged KV pool: sized from the memory budget, allocated once, sharded by KV head.

All layers share one array; layer l owns pages [l * pages_per_layer, (l + 1) *
pages_per_layer). A "block" in the scheduler's sense is the same page index in every
layer, so the scheduler counts `pages_per_layer` blocks. Page 0 of each layer is never
handed out: padded page-table entries point at it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import CPU_KV_CACHE_BYTES, CacheConfig
from jaxserve.sharding import named_sharding

logger = logging.getLogger(__name__)

KV_POOL_AXES = ("kv_pages", "kv_combined_heads", "kv_page_slots", "head_dim")


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: jnp.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block (one page in every layer) takes."""
        per_page = self.page_size * 2 * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize
        return per_page * self.num_layers


def devices_per_block(mesh: Mesh) -> int:
    """The devices one block's bytes are divided over: its KV heads over "model", its layers
    over "stage"."""
    return mesh.shape["model"] * mesh.shape.get("stage", 1)


def num_blocks_for(
    spec: KVCacheSpec,
    cache: CacheConfig,
    max_useful_blocks: int,
    mesh: Mesh,
    memory_stats=None,
    shared: tuple[int, int] = (0, 0),
) -> int:
    """How many blocks fit: exactly --num-gpu-blocks-override when given; else
    --kv-cache-memory-bytes per device, or what --gpu-memory-utilization leaves on the fullest
    device once the weights are there (each device holds 1/tp of every block: the pool is split
    by KV head; under pipeline parallelism, of its stage's layers only), on CPU a fixed host
    budget (CPU_KV_CACHE_BYTES); capped at what max_num_seqs sequences of max_model_len could
    ever use. `memory_stats`: the devices' memory_stats() when
    they cannot be asked (devices of a TPU topology this process only compiles for). `shared`: a
    second pool with as many blocks (a draft model's) and weights still to load, as (its bytes per
    block, its weights' bytes on the fullest device): both come out of the same budget."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]  # this host's
    stats = memory_stats or [d.memory_stats() if d.platform != "cpu" else None for d in devices]
    shared_per_block, shared_weights = shared
    per_block = (spec.bytes_per_block + shared_per_block) / devices_per_block(mesh)
    if cache.kv_cache_memory_bytes is not None:
        free = cache.kv_cache_memory_bytes
        where = f"--kv-cache-memory-bytes={free}"
    elif all(s and "bytes_limit" in s for s in stats):
        limits = [s["bytes_limit"] * cache.gpu_memory_utilization - s.get("bytes_in_use", 0) for s in stats]
        free = min(limits) - shared_weights
        where = f"{free / 2**30:.2f} GiB per device after weights"
    else:
        free = CPU_KV_CACHE_BYTES
        where = f"the CPU's default of {free / 2**30:g} GiB; set --kv-cache-memory-bytes"
    blocks = min(int(free // per_block), max_useful_blocks)
    if jax.process_count() > 1:  # every process must build the same pool: the fullest host decides
        from jax.experimental import multihost_utils

        blocks = int(multihost_utils.process_allgather(np.int64(blocks)).min())
    if blocks < 2:
        raise ValueError(
            f"No memory left for the KV cache ({where}); raise --gpu-memory-utilization, "
            "shard the model over more devices (-tp) or set --num-gpu-blocks-override."
        )
    return blocks


def abstract_kv_pool(spec: KVCacheSpec, num_blocks: int, mesh: Mesh) -> jax.ShapeDtypeStruct:
    """The pool's shape, dtype and sharding: all a step needs to compile before the pool exists."""
    shape = (spec.num_layers * num_blocks, 2 * spec.num_kv_heads, spec.page_size, spec.head_dim)
    return jax.ShapeDtypeStruct(shape, spec.dtype, sharding=named_sharding(mesh, KV_POOL_AXES))


def allocate_kv_pool(
    spec: KVCacheSpec, num_blocks: int, mesh: Mesh, log: bool = True
) -> jax.Array:  # [num_layers * num_blocks, 2 * num_kv_heads, page_size, head_dim]
    pool = abstract_kv_pool(spec, num_blocks, mesh)
    pool = jax.jit(lambda: jnp.zeros(pool.shape, pool.dtype), out_shardings=pool.sharding)()
    if log:
        logger.info(
            "KV cache: %d blocks of %d tokens in %s pages, %.2f GiB per device",
            num_blocks,
            spec.page_size,
            jnp.dtype(spec.dtype).name,
            max(s.data.nbytes for s in pool.addressable_shards) / 2**30,
        )
    return pool
