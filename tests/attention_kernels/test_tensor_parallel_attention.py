"""The attention layer under tensor parallelism: each device writes and attends over its own KV
heads (per_device_heads), for the reference and the GPU kernel (interpreted), with pages in the
model's dtype and in int8. (JAX's TPU interpreter stalls in a step split over CPU devices, so the
engine refuses that pairing; the TPU kernel under tensor parallelism is compiled by libtpu in
test_tpu_compile_check.py.) On a 2-device CPU mesh the step's output and pool must equal the
same step on one device, and the traced step must hold the per-device shard_map rather than let
XLA gather the pool."""

from __future__ import annotations

import json

import pytest
from tiny_models import run_on_fake_devices

SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from attention_kernels.attention_cases import build_case
from jaxserve.layers.attention import AttentionMetadata, paged_attention
from jaxserve.sharding import make_mesh

backend, kv_dtype = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
seqs, page, kv_heads, head_dim = [(0, 7), (20, 1), (33, 5)], 16, 2, 128
case = build_case(rng, seqs, num_q_heads=4, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page,
                  max_num_seqs=4, num_tokens=16)
pool, scales = case.kv, None
if kv_dtype != "auto":
    pool = case.quantized(kv_dtype, 0.03, 0.05).kv
    scales = jnp.asarray([[0.03, 0.05]], jnp.float32)
pages = np.asarray(case.page_indices)
slots = [pages[i, p // page] * page + p % page for i, (c, n) in enumerate(seqs) for p in range(c, c + n)]
slots += [pool.shape[0] * page] * (16 - len(slots))  # padding rows: a slot past the pool
k = jnp.asarray(rng.standard_normal((16, kv_heads, head_dim)), jnp.float32)
v = jnp.asarray(rng.standard_normal((16, kv_heads, head_dim)), jnp.float32)
meta = AttentionMetadata(jnp.asarray(slots, jnp.int32), case.kv_lens, case.page_indices, case.cu_q_lens,
                         case.num_seqs, backend, scales)

def step(q, k, v, pool, meta):
    return paged_attention(q, k, v, pool, jnp.int32(0), pool.shape[0], meta, sm_scale=head_dim ** -0.5)

run = jax.jit(step)
want_out, want_pool = run(case.q, k, v, pool, meta)
with jax.set_mesh(make_mesh(2)):
    traced = str(jax.make_jaxpr(step)(case.q, k, v, pool, meta))
    got_out, got_pool = jax.jit(step)(case.q, k, v, pool, meta)
rows = sum(n for _, n in seqs)
print(json.dumps({
    "shard_maps": traced.count("shard_map["),
    "out_diff": float(np.abs(np.asarray(got_out)[:rows] - np.asarray(want_out)[:rows]).max()),
    "pool_equal": bool(np.array_equal(np.asarray(got_pool, np.float32), np.asarray(want_pool, np.float32))),
    "pool_changed": bool(not np.array_equal(np.asarray(want_pool, np.float32), np.asarray(pool, np.float32))),
}))
"""


@pytest.mark.parametrize("backend", ["reference", "gpu-interpret"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_two_devices_give_the_one_device_step(backend, kv_dtype):
    report = json.loads(run_on_fake_devices(SCRIPT, backend, kv_dtype, devices=2).strip().splitlines()[-1])
    assert report["shard_maps"] == 2  # the write and the attention, each on its own heads
    assert report["pool_changed"] and report["pool_equal"]
    assert report["out_diff"] < 1e-5


def test_the_tpu_interpreter_is_refused_under_tensor_parallelism():
    from jaxserve.args import EngineArgs

    with pytest.raises(ValueError, match="pallas-tpu-interpret runs on one device"):
        EngineArgs(
            model="unused", attention_backend="pallas-tpu-interpret", tensor_parallel_size=2
        ).create_engine_config()
