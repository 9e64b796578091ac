"""A quantized KV pool's per-layer scales measured at start-up (`--calculate-kv-scales`): the
model prefills calibration tokens into a float32 pool of their own, and each layer's largest
|key| and |value| there sets its scales (runner/kv_scales.py scales_from_amax)."""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner import batch as batch_lib
from jaxserve.runner import kv_scales
from jaxserve.runner.kv_cache import allocate_kv_pool
from jaxserve.runner.step import StepVariant, forward
from jaxserve.scheduler_output import ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)


def measure(runner, ids: tuple[int, ...]) -> np.ndarray:
    """[num_layers, 2] float32 scales of `runner`'s pool dtype from a prefill of `ids`."""
    blocks = -(-len(ids) // runner.page_size)
    spec = dataclasses.replace(runner.kv_spec, dtype=jnp.dtype(jnp.float32))
    pool = allocate_kv_pool(spec, blocks + 1, runner.mesh, log=False)
    seq = ScheduledSeq("calibration", ids, 0, tuple(range(1, blocks + 1)), None)
    inputs = batch_lib.prepare(
        SchedulerOutput(seqs=(seq,)),
        len(ids),
        1,
        runner.page_size,
        blocks,
        (blocks + 1) * runner.args.num_layers * runner.page_size,
        runner.attention_backend,
    )
    run = jax.jit(partial(forward, graphdef=runner.graphdef, variant=StepVariant(), num_top_logprobs=1))
    replicated = jax.sharding.NamedSharding(runner.mesh, jax.sharding.PartitionSpec())
    with jax.set_mesh(runner.mesh):
        pool, *_ = run(runner.state, pool, runner._last_tokens, jax.device_put(inputs, replicated))
    # [layers * pages, 2 * heads, page, head_dim] -> largest |k| and |v| of each layer
    amax = jnp.abs(pool).reshape(
        runner.args.num_layers, -1, spec.num_kv_heads, 2, spec.page_size, spec.head_dim
    )
    amax = np.asarray(jnp.max(amax, axis=(1, 2, 4, 5)))
    scales = kv_scales.scales_from_amax(amax, runner.kv_spec.dtype.name)
    logger.info(
        "KV cache scales (%s) measured over %d tokens: keys %.3g-%.3g, values %.3g-%.3g",
        runner.kv_spec.dtype.name, len(ids),
        scales[:, 0].min(), scales[:, 0].max(), scales[:, 1].min(), scales[:, 1].max(),
    )  # fmt: skip
    return scales
