"""A vision-language model's image encoder, run by the runner at the start of a step whose rows
hold image tokens, and its cache of encoded images.

A step's rows name their images (ScheduledSeq.images, jaxserve/multimodal/images.py); those not in
the cache are encoded a tile at a time (one program, compiled at start-up, whatever the image's
size), and each row gets its image rows as prompt-embedding rows at its
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


def _tile_rows(state: nnx.State, tile: jax.Array, *, graphdef: nnx.GraphDef) -> jax.Array:
    return nnx.merge(graphdef, state).image_features(tile[None])


class ImageEncoder:
    def __init__(self, graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh, cache_bytes: int):
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._program = jax.jit(partial(_tile_rows, graphdef=graphdef), out_shardings=self._replicated)
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.hits = self.misses = 0  # images found in the cache / encoded
        self._compiled: dict[tuple[int, ...], jax.stages.Compiled] = {}  # by tile shape

    def compile(self, state: nnx.State, tile_shape: tuple[int, ...]) -> None:
        """Compile the encoder for tiles of `tile_shape` (start-up: no request waits on it)."""
        tile = jax.ShapeDtypeStruct(tile_shape, np.float32, sharding=self._replicated)
        self._compiled[tuple(tile_shape)] = self._program.lower(state, tile).compile()

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
        """One call per tile (a tile is hundreds of patches through the whole encoder: the
        calls' overhead is negligible beside it, and no padding tile is ever encoded), all
        dispatched before the first result is read."""
        program = self._compiled.get(items[0].pixel_values.shape[1:], self._program)
        rows = [
            program(state, jax.device_put(tile, self._replicated)) for i in items for tile in i.pixel_values
        ]
        at = 0
        for item in items:
            tiles = rows[at : at + len(item.pixel_values)]
            at += len(tiles)
            # replicated: every device holds all of a tile's rows
            self._cache[item.digest] = np.concatenate(
                [np.asarray(r.addressable_shards[0].data) for r in tiles]
            )

    def _evict(self, keep: dict) -> None:
        size = sum(r.nbytes for r in self._cache.values())
        for digest in list(self._cache):
            if size <= self.cache_bytes:
                break
            if digest not in keep:
                size -= self._cache.pop(digest).nbytes
