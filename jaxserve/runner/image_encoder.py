"""A vision-language model's image encoder, run by the runner at the start of a step whose rows
hold image tokens, and its cache of encoded images.

A step's rows name their images (ScheduledSeq.images, jaxserve/multimodal/images.py); those not in
the cache are encoded together in one call (their tiles padded to a power of two: one program per
bucket, not per image size), and each row gets its image rows as prompt-embedding rows at its
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


def _image_features(state: nnx.State, pixel_values: jax.Array, *, graphdef: nnx.GraphDef) -> jax.Array:
    return nnx.merge(graphdef, state).image_features(pixel_values)


class ImageEncoder:
    def __init__(self, graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh, cache_bytes: int):
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._program = jax.jit(partial(_image_features, graphdef=graphdef), out_shardings=self._replicated)
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.hits = self.misses = 0  # images found in the cache / encoded

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
        tiles = np.concatenate([i.pixel_values for i in items])
        bucket = 1 << (len(tiles) - 1).bit_length()
        padded = np.zeros((bucket, *tiles.shape[1:]), np.float32)
        padded[: len(tiles)] = tiles
        out = self._program(state, jax.device_put(padded, self._replicated))
        rows = np.asarray(out.addressable_shards[0].data)  # replicated: every device has all
        per_tile = rows.shape[0] // bucket
        at = 0
        for item in items:
            n = item.pixel_values.shape[0] * per_tile
            self._cache[item.digest] = rows[at : at + n].copy()
            at += n

    def _evict(self, keep: dict) -> None:
        size = sum(r.nbytes for r in self._cache.values())
        for digest in list(self._cache):
            if size <= self.cache_bytes:
                break
            if digest not in keep:
                size -= self._cache.pop(digest).nbytes
