"""How big the KV pool is: --gpu-memory-utilization of each device after its weights (the
pool split over the tensor-parallel devices), --kv-cache-memory-bytes, the CPU budget; and
the pool as allocated."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import CPU_KV_CACHE_BYTES, CacheConfig
from jaxserve.runner.kv_cache import KVCacheSpec, abstract_kv_pool, allocate_kv_pool, num_blocks_for
from jaxserve.sharding import make_mesh

SPEC = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype=jnp.bfloat16)
GIB = 1 << 30


def _mesh(in_use: list[int], limit: int = 16 * GIB):
    class Device:
        platform = "gpu"
        process_index = 0

        def __init__(self, used):
            self.used = used

        def memory_stats(self):
            return {"bytes_limit": limit, "bytes_in_use": self.used}

    return SimpleNamespace(devices=np.array([Device(u) for u in in_use]), shape={"model": len(in_use)})


def test_blocks_fill_the_share_left_on_the_fullest_device():
    per_block = SPEC.bytes_per_block  # 4 layers * 16 tokens * 2 * 8 heads * 128 * 2 bytes = 256 KiB
    assert per_block == 4 * 16 * 2 * 8 * 128 * 2
    cache = CacheConfig(gpu_memory_utilization=0.5)
    one = num_blocks_for(SPEC, cache, 10**9, _mesh([2 * GIB]))
    assert one == (8 * GIB - 2 * GIB) // per_block
    # two devices each hold half of every block; the fuller one decides
    two = num_blocks_for(SPEC, cache, 10**9, _mesh([1 * GIB, 3 * GIB]))
    assert two == int((8 * GIB - 3 * GIB) // (per_block / 2))
    assert num_blocks_for(SPEC, cache, 100, _mesh([2 * GIB])) == 100  # no more than can be used
    assert num_blocks_for(SPEC, CacheConfig(num_gpu_blocks_override=7), 100, _mesh([15 * GIB])) == 7


def test_a_draft_models_pool_and_weights_share_the_budget():
    """A second pool of as many blocks (a draft model's, here a quarter the size per block) and
    weights still to load (1 GiB per device) come out of what the devices have left."""
    cache = CacheConfig(gpu_memory_utilization=0.5)
    draft_block = SPEC.bytes_per_block // 4
    blocks = num_blocks_for(SPEC, cache, 10**9, _mesh([2 * GIB]), shared=(draft_block, GIB))
    assert blocks == (8 * GIB - 2 * GIB - GIB) // (SPEC.bytes_per_block + draft_block)
    two = num_blocks_for(SPEC, cache, 10**9, _mesh([1 * GIB, 3 * GIB]), shared=(draft_block, GIB))
    assert two == int((8 * GIB - 3 * GIB - GIB) // ((SPEC.bytes_per_block + draft_block) / 2))
    budget = CacheConfig(kv_cache_memory_bytes=GIB)  # the pools' budget, whatever the weights
    assert num_blocks_for(SPEC, budget, 10**9, _mesh([2 * GIB]), shared=(draft_block, GIB)) == GIB // (
        SPEC.bytes_per_block + draft_block
    )


def test_no_room_left_is_a_clear_error():
    with pytest.raises(ValueError, match="No memory left for the KV cache.*per device after weights"):
        num_blocks_for(SPEC, CacheConfig(gpu_memory_utilization=0.5), 100, _mesh([8 * GIB]))


def test_cpu_uses_the_host_budget():
    cpu = SimpleNamespace(platform="cpu", process_index=0, memory_stats=lambda: None)
    mesh = SimpleNamespace(devices=np.array([cpu]), shape={"model": 1})
    assert num_blocks_for(SPEC, CacheConfig(), 10**9, mesh) == CPU_KV_CACHE_BYTES // SPEC.bytes_per_block
    blocks = num_blocks_for(SPEC, CacheConfig(kv_cache_memory_bytes=GIB // 4), 10**9, mesh)
    assert blocks == GIB // 4 // SPEC.bytes_per_block


def test_kv_cache_memory_bytes_overrides_the_utilization():
    """vLLM's --kv-cache-memory-bytes: that many bytes of pool per device, whatever is free."""
    mesh = _mesh([8 * GIB, 8 * GIB])
    blocks = num_blocks_for(SPEC, CacheConfig(kv_cache_memory_bytes=GIB), 10**9, mesh)
    assert blocks == GIB // (SPEC.bytes_per_block / 2)
    with pytest.raises(ValueError, match="No memory left for the KV cache.*--kv-cache-memory-bytes=1000"):
        num_blocks_for(SPEC, CacheConfig(kv_cache_memory_bytes=1000), 10**9, mesh)


def test_the_pool_is_every_layers_pages_in_one_zeroed_array():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=jnp.bfloat16)
    mesh = make_mesh(1)
    pool = allocate_kv_pool(spec, 5, mesh)
    abstract = abstract_kv_pool(spec, 5, mesh)
    # layer l's pages are [l * 5, (l + 1) * 5); k and v of each head interleaved on axis 1
    assert pool.shape == abstract.shape == (3 * 5, 2 * 2, 4, 8)
    assert pool.dtype == abstract.dtype == jnp.bfloat16
    assert pool.sharding.is_equivalent_to(abstract.sharding, pool.ndim)
    assert pool.nbytes == 5 * spec.bytes_per_block
    assert not np.asarray(pool, np.float32).any()
