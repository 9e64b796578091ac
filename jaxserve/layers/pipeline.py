"""A model's layers run in turn, as one scan, or as stages of a pipeline.

Under pipeline parallelism the mesh has a "stage" axis of size > 1 (sharding.py): the layer
stacks, every per-layer input and the KV pool (which holds each layer's pages in turn) are split
over it, so each stage's devices hold the weights and pages of its own consecutive layers. The
step is still one SPMD program for all devices (one process or several, as tensor parallelism):
a shard_map, manual over "stage" only (tensor parallelism inside a stage splits as everywhere
else). Inside a stage a layer's index is its index within the stage: what it reads by index (a
4-bit kernel's stack, its pages, its KV scales) is the stage's.

Microbatches keep the stages busy together. A step's tokens are cut into M equal microbatches
(consecutive token ranges; a sequence may run across two) and the stages work in ticks: at
tick t stage s runs its layers on microbatch t - s, so M + S - 1 ticks pass the M microbatches
through S stages, with S stages working at once in all but the first and last S - 1 ticks.
After each tick every stage hands its activations to the next one (one collective permute);
the last stage's outputs are then shared with every stage, which computes the head. Causality
needs no more than the tick order: a stage runs microbatch m + 1 after microbatch m, so the
keys and values m wrote into the stage's pages are there when m + 1 attends to them, and each
microbatch's attention metadata is the step's, cut to its tokens (`microbatch_metadata`).

How many: the fewest ticks of the step's time. A tick lasts as long as a stage's microbatch:
its compute, or, for a microbatch of fewer rows than the chip's ridge point, the time the stage
reads its weights in (AttentionMetadata.microbatch_tokens: --compilation-config
pipeline_microbatch_tokens, by default the chip's peak flops over its HBM bandwidth, 241 rows for
a v5e, 560 for a v6e; 256 elsewhere). M microbatches take M + S - 1 ticks: a decode step's few
rows go through as one batch (the stages take turns; cutting them would read each stage's
weights once per microbatch), a prefill of T tokens in as many microbatches of about the ridge's
rows as pay for their bubble of S - 1 ticks. The schedule is within the step: the engine keeps one
step in the pipeline, and asynchronous scheduling plans the next step while this one runs, as
without stages. Models whose attention sees a whole sequence at once (encoders) pass no
per-token inputs and always go through as one batch.

`record_timeline` compiles host callbacks into the step that stamp when each stage starts and
ends each microbatch: what benchmarks/pipeline_parallel.py draws the overlap from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import PartitionSpec

STAGE_AXIS = "stage"


def num_stages() -> int:
    """Pipeline stages of the mesh the step is traced under (1: no pipeline)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.shape.get(STAGE_AXIS, 1)


def num_microbatches(num_tokens: int, ridge_tokens: int, stages: int) -> int:
    """The microbatches (a power of two dividing the tokens) that pass a step of `num_tokens`
    through `stages` soonest: M of them take M + S - 1 ticks, and a tick takes a microbatch's
    compute, or, for one shorter than `ridge_tokens` rows, the time the stage reads its weights
    in (as long as `ridge_tokens` rows take to compute). 1 when `ridge_tokens` is 0."""

    def duration(m):  # in rows' compute
        return (m + stages - 1) * max(num_tokens // m, ridge_tokens)

    best, m = 1, 2
    while ridge_tokens and num_tokens % m == 0:
        best = m if duration(m) < duration(best) else best
        m *= 2
    return best


def microbatch_metadata(meta, start: jax.Array, size: int):
    """The step's attention metadata for its tokens [start, start + size): each sequence's query
    rows cut to the range (none for a sequence wholly outside it), its KV length less its tokens
    after the range (not written yet when the range runs), the range's KV slots."""
    cu = meta.cu_q_lens
    end = start + size
    after = cu[1:] - jnp.clip(cu[1:], start, end)
    return dataclasses.replace(
        meta,
        slot_mapping=jax.lax.dynamic_slice_in_dim(meta.slot_mapping, start, size),
        cu_q_lens=jnp.clip(cu, start, end) - start,
        kv_lens=meta.kv_lens - after,
    )


@dataclasses.dataclass
class Timeline:
    """Host times (time.perf_counter) at which each stage started and ended each microbatch of
    the steps that ran while recording: (seconds, stage, microbatch, microbatches, "start" or
    "end"), one per device of the stage."""

    events: list[tuple[float, int, int, int, str]] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def stamp(self, kind: str, stage, microbatch, microbatches: int) -> np.float32:
        with self.lock:
            self.events.append((time.perf_counter(), int(stage), int(microbatch), microbatches, kind))
        return np.float32(0)


_recording: Timeline | None = None


def recording() -> bool:
    """Whether steps traced now carry the timeline's callbacks (part of a stored step's key)."""
    return _recording is not None


@contextlib.contextmanager
def record_timeline() -> Iterator[Timeline]:
    """Steps traced inside this block stamp a Timeline whenever they run (also after the block).
    For measuring only: each stamp is a host round trip."""
    global _recording
    _recording = Timeline()
    try:
        yield _recording
    finally:
        _recording = None


def _stamp(timeline: Timeline, kind: str, stage, microbatch, microbatches: int, after: jax.Array):
    """0.0, once `after` is computed and the stamp taken (add it to what must follow the stamp).
    The callback runs under a region manual over the other axes as well: JAX refuses a callback
    where some axes are still partitioned automatically."""
    mesh = jax.sharding.get_abstract_mesh()
    others = set(mesh.axis_names) - {STAGE_AXIS}

    def local(stage, microbatch, after):
        return io_callback(
            lambda s, m, _: timeline.stamp(kind, s, m, microbatches),
            jax.ShapeDtypeStruct((), jnp.float32),
            stage,
            microbatch,
            after,
        )

    if not others:
        return local(stage, microbatch, jnp.sum(after[:1, :1]))
    same = PartitionSpec()
    probe = jax.shard_map(
        local, mesh=mesh, in_specs=(same,) * 3, out_specs=same, axis_names=others, check_vma=False
    )
    return probe(stage, microbatch, jnp.sum(after[:1, :1]))


def run_layers(
    layer: Callable,  # (carry, per-layer inputs, whole, meta, shared) -> (carry, None)
    x: jax.Array,  # [tokens, hidden]
    kv_pool: jax.Array | None,  # layer-major pages (None: a model without a cache)
    per_layer: dict[str, Any],  # arrays [num_layers, ...], each layer's slice handed to `layer`
    whole: Any = None,  # arrays [num_layers, ...] a layer reads whole, at its index
    meta: Any = None,  # AttentionMetadata: its kv_scales [num_layers, 2] are per layer
    shared: Any = None,  # the arrays every layer reads (positions, LoRA masks...)
    token_keys: Sequence[str] | None = None,  # the entries of `shared` (a dict) that are per token
) -> tuple[jax.Array, jax.Array | None]:
    """(x, kv_pool) after every layer: `layer((x, kv_pool), per_layer_l, whole, meta, shared)`
    for each layer l, with per_layer_l["index"] the layer's index (within its stage under a
    pipeline). `layer` must read traced arrays only from its arguments: one it closed over would
    carry the mesh outside the stages into them, which JAX refuses where it indexes the array.
    Under a pipeline, `layer` may be handed a microbatch: a range of the tokens, with `meta` and
    the `token_keys` entries of `shared` (leading axis: the token) cut to it; without
    `token_keys` the step is never cut."""

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
    cut = token_keys is not None and meta is not None and kv_pool is not None
    micro = num_microbatches(x.shape[0], meta.microbatch_tokens, stages) if cut else 1
    size = x.shape[0] // micro
    timeline = _recording

    def stage_body(x, kv_pool, per_layer, whole, meta, shared):
        stage = jax.lax.axis_index(STAGE_AXIS)
        if meta is not None and meta.kv_scales is not None:
            own = jax.lax.dynamic_slice_in_dim(meta.kv_scales, stage * local_layers, local_layers)
            meta = dataclasses.replace(meta, kv_scales=own)

        def run(h, kv_pool, m):
            start = m * size
            mb_meta, mb_shared = meta, shared
            if micro > 1:
                mb_meta = microbatch_metadata(meta, start, size)
                mb_shared = {
                    k: jax.lax.dynamic_slice_in_dim(v, start, size)
                    if k in token_keys and v is not None
                    else v
                    for k, v in shared.items()
                }
            if timeline is not None:
                h = h + _stamp(timeline, "start", stage, m, micro, h).astype(h.dtype)
            h, kv_pool = scan(h, kv_pool, per_layer, whole, mb_meta, mb_shared)
            if timeline is not None:
                h = h + _stamp(timeline, "end", stage, m, micro, h).astype(h.dtype)
            return h, kv_pool

        def tick(carry, t):
            inbox, out, kv_pool = carry
            m = t - stage  # the microbatch this stage works on at this tick
            active = (m >= 0) & (m < micro)
            m = jnp.clip(m, 0, micro - 1)
            h = jnp.where(stage == 0, jax.lax.dynamic_slice_in_dim(x, m * size, size), inbox)
            h, kv_pool = jax.lax.cond(active, run, lambda h, kv_pool, m: (h, kv_pool), h, kv_pool, m)
            done = active & (stage == stages - 1)
            mine = jax.lax.dynamic_slice_in_dim(out, m * size, size)
            out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(done, h, mine), m * size, 0)
            # to the next stage (the first gets the last's, which it never reads)
            inbox = jax.lax.ppermute(h, STAGE_AXIS, [(s, (s + 1) % stages) for s in range(stages)])
            return (inbox, out, kv_pool), None

        first = (jnp.zeros((size, x.shape[1]), x.dtype), jnp.zeros_like(x), kv_pool)
        (_, out, kv_pool), _ = jax.lax.scan(tick, first, jnp.arange(micro + stages - 1))
        return jax.lax.psum(jnp.where(stage == stages - 1, out, jnp.zeros_like(out)), STAGE_AXIS), kv_pool

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
