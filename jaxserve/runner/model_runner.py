"""The device side: owns the parameters, the KV pool and the compiled steps.

The model is split once into (graphdef, state); one pure step function (forward over a
ragged batch, logits at sampled rows, sampling) is compiled ahead of time for every
shape bucket, with the KV pool donated so it is updated in place. `execute` turns a
SchedulerOutput into one host->device transfer, one compiled call and one packed
device->host copy.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxserve.config import EngineConfig, jaxserve_cache_dir
from jaxserve.layers.sampler import sample
from jaxserve.loader.model_loader import build_model_args, load_model
from jaxserve.runner import batch as batch_lib
from jaxserve.runner.bucketing import Buckets
from jaxserve.runner.kv_cache import KVCacheSpec, allocate_kv_pool, num_blocks_for
from jaxserve.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.sharding import make_mesh

logger = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: str | None) -> None:
    """JAX's persistent compilation cache: a second start-up reads compiled steps from disk."""
    if cache_dir == "":
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir or jaxserve_cache_dir("xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class ModelRunner:
    def __init__(self, config: EngineConfig, mesh: jax.sharding.Mesh | None = None):
        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        enable_compilation_cache(config.compilation_config.cache_dir)
        self.mesh = mesh or make_mesh(config.parallel_config.tensor_parallel_size)
        _, self.args = build_model_args(mc, config.parallel_config)
        start = time.perf_counter()
        self.graphdef, self.state = load_model(mc, self.mesh, config.parallel_config)
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(self.state))
        logger.info("Loaded weights (%.1f MiB) in %.2f s", weight_bytes / 2**20, time.perf_counter() - start)

        self.page_size = cc.block_size
        self.pages_per_seq = -(-sc.max_model_len // self.page_size)
        self.kv_spec = KVCacheSpec(
            num_layers=self.args.num_layers,
            num_kv_heads=self.args.num_kv_heads,
            head_dim=self.args.head_dim,
            page_size=self.page_size,
            dtype=jnp.dtype(mc.dtype),
        )
        max_useful = sc.max_num_seqs * self.pages_per_seq + 1
        self.num_blocks = num_blocks_for(self.kv_spec, cc, weight_bytes, max_useful)
        self.kv_pool = allocate_kv_pool(self.kv_spec, self.num_blocks, self.mesh)
        self.pad_slot = self.num_blocks * self.args.num_layers * self.page_size

        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self.buckets = Buckets.from_config(sc, config.compilation_config)
        self._jitted = jax.jit(self._step, donate_argnums=(1,))
        self._compiled: dict[tuple[int, int], jax.stages.Compiled] = {}
        if not config.compilation_config.enforce_eager:
            self.precompile()

    def _step(self, state, kv_pool, inputs: batch_lib.BatchInputs):
        model = nnx.merge(self.graphdef, state)
        logits, kv_pool = model(
            inputs.input_ids, inputs.positions, kv_pool, inputs.meta, inputs.logits_indices
        )
        tokens, logprobs = sample(logits, inputs.sampling)
        packed = jnp.stack([jax.lax.bitcast_convert_type(tokens, jnp.float32), logprobs])  # [2, num_seqs]
        return kv_pool, packed

    def _dummy_inputs(self, num_tokens: int, num_seqs: int) -> batch_lib.BatchInputs:
        return batch_lib.prepare(
            SchedulerOutput(seqs=()), num_tokens, num_seqs, self.page_size, self.pages_per_seq, self.pad_slot
        )

    def _compile(self, bucket: tuple[int, int]) -> jax.stages.Compiled:
        compiled = self._compiled.get(bucket)
        if compiled is None:
            inputs = jax.device_put(self._dummy_inputs(*bucket), self._replicated)
            with jax.set_mesh(self.mesh):  # layers that split work by hand (MoE experts) read it
                compiled = self._jitted.lower(self.state, self.kv_pool, inputs).compile()
            self._compiled[bucket] = compiled
        return compiled

    def precompile(self) -> None:
        start = time.perf_counter()
        buckets = self.buckets.all()
        for bucket in tqdm(buckets, desc="Compiling step buckets", disable=None):
            self._compile(bucket)
        logger.info("Compiled %d step buckets in %.1f s", len(buckets), time.perf_counter() - start)

    @property
    def kv_pool_lost(self) -> bool:
        """True after a failed call consumed the donated pool without returning a new one."""
        return self.kv_pool.is_deleted()

    def reset_kv_pool(self) -> None:
        self.kv_pool = allocate_kv_pool(self.kv_spec, self.num_blocks, self.mesh)

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        bucket = self.buckets.pick(sched.num_tokens, len(sched.seqs))
        inputs = batch_lib.prepare(sched, *bucket, self.page_size, self.pages_per_seq, self.pad_slot)
        step = self._compile(bucket)
        self.kv_pool, packed = step(self.state, self.kv_pool, jax.device_put(inputs, self._replicated))
        packed = np.asarray(packed)  # the one device->host copy
        rows = [i for i, s in enumerate(sched.seqs) if s.sampling is not None]
        return ModelRunnerOutput(
            req_ids=tuple(sched.seqs[i].request_id for i in rows),
            sampled_token_ids=packed[0, rows].view(np.int32),
            logprobs=packed[1, rows],
        )
