"""Sleep mode (vLLM's --enable-sleep-mode): hand a model's device memory back between uses and
take it again, for a process that shares its accelerator with something else (a trainer between
rounds of generation).

The weights' device arrays are freed shard by shard, after a copy of each shard to host memory
(level 1) or none (level 2: waking reads the checkpoint again). Waking puts arrays of the same
shapes, dtypes and shardings back, so the compiled steps run on them as before: nothing compiles.
Each process copies and restores only its own shards, so this works across hosts too."""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Hashable

import jax
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

# What a sleeping engine has let go of, and what wake_up(tags) may take back (vLLM's names).
TAGS = ("weights", "kv_cache")


class HostShards:
    """One device array as host copies of this process's shards, to be put back as it was."""

    def __init__(self, array: jax.Array) -> None:
        self.shape, self.dtype, self.sharding = array.shape, array.dtype, array.sharding
        self.shards = [(s.device, np.asarray(s.data)) for s in array.addressable_shards]

    @property
    def nbytes(self) -> int:
        return sum(data.nbytes for _, data in self.shards)

    def to_device(self) -> jax.Array:
        kind = self.sharding.memory_kind  # (offloaded weights come back to host memory)
        pieces = [
            jax.device_put(data, SingleDeviceSharding(device, memory_kind=kind))
            for device, data in self.shards
        ]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, pieces)


def release(state: nnx.State, keep: Container[Hashable] | None = None) -> dict[Hashable, HostShards]:
    """Free the device arrays of `state`, first copying to host memory those whose key is in
    `keep` (None: all); returns the copies by key. An array two keys share is copied once."""
    copies: dict[int, HostShards] = {}
    saved = {}
    for key, var in state.flat_state():
        array = var.value
        if keep is None or key in keep:
            if id(array) not in copies:
                copies[id(array)] = HostShards(array)
            saved[key] = copies[id(array)]
        if not array.is_deleted():
            array.delete()
    return saved


def restore(state: nnx.State, saved: dict[Hashable, HostShards]) -> None:
    """Put the copies `release` made back on their devices, into `state` (in place)."""
    put: dict[int, jax.Array] = {}
    flat = dict(state.flat_state())
    for key, host in saved.items():
        if id(host) not in put:
            put[id(host)] = host.to_device()
        flat[key].value = put[id(host)]


class OffDevice:
    """A model's weights while they are off the devices: host copies of all of them (level 1)
    or of the LoRA slots only (level 2: waking reads the checkpoint again)."""

    def __init__(self, state: nnx.State, level: int, lora_keys: Collection[Hashable]) -> None:
        self.lora_keys = frozenset(lora_keys)
        self.reload = level == 2
        self.saved = release(state, None if level == 1 else self.lora_keys)

    def deepen(self, level: int) -> None:
        """Sleep again: at level 2 the host copy goes, but for the LoRA slots."""
        if level == 2:
            self.saved = {k: v for k, v in self.saved.items() if k in self.lora_keys}
            self.reload = True

    def restore(self, state: nnx.State, load: Callable[[], nnx.State]) -> nnx.State:
        """The weights back on their devices: `state` refilled, or after level 2 what `load`
        reads from the checkpoint with the LoRA slots refilled."""
        state = load() if self.reload else state
        restore(state, self.saved)
        return state
