"""A vision-language model's image encoder, run by the runner at the start of a step whose rows
hold image tokens, and its cache of encoded images.

A step's rows name their images (ScheduledSeq.images, jaxserve/multimodal/images.py); those not in
the cache are encoded by the model's `image_call` (Idefics3: once per tile, one program whatever
the image's size; Qwen2-VL: once per image, its patches padded to a power of two), compiled at
start-up, and each row gets its image rows as prompt-embedding rows at its
image tokens (ScheduledSeq.prompt_embeds as (offsets, rows)), which the step feeds in place of the
embedding table's. The rows stay in host memory, keyed by the image's digest, so the chunks of a
long prompt, a preempted request's recompute and other requests with the same image encode it
once; least recently used first out past `cache_bytes` when a step next needs the encoder (0,
--disable-mm-preprocessor-cache: each step encodes the images it feeds). Every process of a multi-host engine replays the step, so
each runs the same encoder calls on its own devices and keeps the same cache.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from functools import partial
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from jaxserve.multimodal.images import ImageItem, ImageRows


def _call_rows(state: nnx.State, *args: jax.Array, graphdef: nnx.GraphDef) -> jax.Array:
    return nnx.merge(graphdef, state).image_call(*args)


def image_call_program(graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh):
    """The model's `image_call` as a program of (weights, *its arguments), its rows replicated
    (how the runner calls it, and the TPU compile check compiles it)."""
    return jax.jit(partial(_call_rows, graphdef=graphdef), out_shardings=NamedSharding(mesh, PartitionSpec()))


class ImageEncoder:
    def __init__(self, graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh, cache_bytes: int):
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._program = image_call_program(graphdef, mesh)
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.hits = self.misses = 0  # images found in the cache / encoded
        # compiled calls by their arguments' shapes
        self._compiled: dict[tuple[tuple[int, ...], ...], jax.stages.Compiled] = {}

    def compile(self, state: nnx.State, call_shapes: list[tuple[jax.ShapeDtypeStruct, ...]]) -> None:
        """Compile the encoder's calls of these argument shapes (start-up: no request waits on
        them; a call of another shape compiles when first made)."""
        for shapes in call_shapes:
            args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._replicated) for x in shapes]
            self._compiled[tuple(x.shape for x in shapes)] = self._program.lower(state, *args).compile()

    def feed(self, state: nnx.State, sched: SchedulerOutput) -> SchedulerOutput:
        """The step with its rows' image rows as prompt-embedding rows, encoding what the cache
        lacks first."""
        wanted = {i.digest: i for s in sched.seqs if s.images is not None for i in s.images.items}
        self._evict(keep=wanted)
        missing = [i for d, i in wanted.items() if d not in self._cache]
        self.hits += len(wanted) - len(missing)
        self.misses += len(missing)
        if missing:
            self._encode(state, missing)
        for digest in wanted:
            self._cache.move_to_end(digest)
        seqs = tuple(
            s if s.images is None else s._replace(prompt_embeds=self._rows(s.images), images=None)
            for s in sched.seqs
        )
        return dataclasses.replace(sched, seqs=seqs)

    def _rows(self, images: ImageRows) -> tuple[np.ndarray, np.ndarray]:
        rows = [self._cache[i.digest] for i in images.items]
        rows = rows[0] if len(rows) == 1 else np.concatenate(rows)
        return images.offsets, rows[images.first_row : images.first_row + len(images.offsets)]

    def _encode(self, state: nnx.State, items: list[ImageItem]) -> None:
        """Every call of every item dispatched before the first result is read."""
        outs = [[self._call(state, args) for args in item.calls] for item in items]
        for item, rows in zip(items, outs, strict=True):
            # replicated: every device holds all of a call's rows
            rows = np.concatenate([np.asarray(r.addressable_shards[0].data) for r in rows])
            self._cache[item.digest] = rows[: item.num_rows].copy()

    def _call(self, state: nnx.State, args: tuple[np.ndarray, ...]) -> jax.Array:
        program = self._compiled.get(tuple(a.shape for a in args), self._program)
        return program(state, *(jax.device_put(a, self._replicated) for a in args))

    def _evict(self, keep: dict) -> None:
        size = sum(r.nbytes for r in self._cache.values())
        for digest in list(self._cache):
            if size <= self.cache_bytes:
                break
            if digest not in keep:
                size -= self._cache.pop(digest).nbytes
