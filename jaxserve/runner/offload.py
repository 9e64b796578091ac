"""CPU weight offload (`--cpu-offload-gb N`, vLLM's flag): N GiB of each device's layer weights
kept in host memory instead of the device's, which leaves that much more device memory to the KV
pool (StepLayout.plan measures what the devices hold after this).

What moves are whole stacks of the decoder layers' weights ([layers, ...], the largest first, until
N GiB of each device's share have moved), placed in the devices' pinned host memory with their own
sharding. The layer scan slices a stack as usual and `LayerWeights` copies each layer's slice to
the device where it is read (`jax.device_put(..., jax.memory.Space.Device)` inside the step), so a
step copies each offloaded weight in once; XLA schedules those copies (on a TPU or GPU, ahead of
the layer that reads them, beside the layer before). Stacks that a kernel reads whole by the layer's
index (the native 4-bit kernel's) and LoRA slots stay on the devices.
"""

from __future__ import annotations

import logging

import jax
from flax import nnx

from jaxserve.layers.linear import LayerWeights
from jaxserve.sharding import per_device_bytes

logger = logging.getLogger(__name__)


def offload_layers(state: nnx.State, gib: float) -> tuple[nnx.State, int]:
    """The state with the largest layer stacks in pinned host memory, until `gib` GiB of the
    fullest device's share are there (or every candidate is); and those bytes per device."""
    if gib <= 0:
        return state, 0
    stacks = {path: var for path, var in state.flat_state() if path[0] == "layers"}
    sliced, _ = LayerWeights.split({path[-1]: var.get_value() for path, var in stacks.items()})
    candidates = [
        (path, var)
        for path, var in stacks.items()
        if path[-1] in sliced and "lora" not in "/".join(map(str, path))
    ]
    candidates.sort(key=lambda pv: -per_device_bytes(pv[1].get_value()))
    moved, goal = 0, int(gib * (1 << 30))
    for _, var in candidates:
        if moved >= goal:
            break
        x = var.get_value()
        var.set_value(jax.device_put(x, x.sharding.with_memory_kind("pinned_host")))
        moved += per_device_bytes(x)
    if moved < goal:
        logger.warning(
            "--cpu-offload-gb %.2f: only %.2f GiB of each device's layer weights can move to host memory.",
            gib,
            moved / (1 << 30),
        )
    return state, moved
