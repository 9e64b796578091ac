"""LoRA slots on the device: which of the model's arrays hold them, what adapters they take, and
the one compiled program that writes an adapter into a slot.

The scheduler decides which adapter sits in which slot (engine/lora_slots.py); the runner writes
it here before the step that first reads it. Ranks are padded to the slots' rank with zeros, so
one program serves any slot and any adapter and loading or swapping adapters never compiles.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxserve.layers.linear import KV_PROJECTIONS, LORA_SUFFIXES, lora_a_members, lora_group
from jaxserve.loader.model_loader import repeat_kv_heads
from jaxserve.lora.adapter import AdapterSpec, LoRAAdapter


def lora_keys(state: nnx.State) -> list[tuple]:
    """The state's paths of LoRA slot arrays (empty for a model without slots)."""
    return sorted(k for k, _ in state.flat_state() if str(k[-1]).endswith(LORA_SUFFIXES))


class LoRAWriter:
    """Writes adapters into the LoRA slot arrays of a model's state."""

    def __init__(self, state: nnx.State, args, mesh: jax.sharding.Mesh):
        self.keys = lora_keys(state)
        self.args, self.mesh = args, mesh
        self._program = None  # compiled on the first write

    def adapter_spec(self, state: nnx.State, model_cls, split_tensors, lora) -> AdapterSpec:
        """What adapters the slots take (lora/adapter.py): the projections with slots and their
        (in, out) as the checkpoint has them."""
        flat = dict(state.flat_state())
        copies = getattr(self.args, "kv_head_copies", 1)
        shapes = {}
        for key in self.keys:
            proj, part = str(key[-1]).rsplit("_lora_", 1)
            if part == "b":
                group = "".join(lora_group(proj.removesuffix("_proj")))
                d_in = flat[(*key[:-1], f"{group}_proj_lora_a")].value.shape[2]
                d_out = flat[key].value.shape[-1]
                shapes[proj] = (d_in, d_out // copies if proj in KV_PROJECTIONS else d_out)
        return AdapterSpec(
            self.args.num_layers,
            shapes,
            model_cls.hf_weight_map(self.args),
            split_tensors,
            self.args,
            lora.max_lora_rank,
            lora.bias,
        )

    def write(self, state: nnx.State, slot: int, adapter: LoRAAdapter | None) -> None:
        """Write an adapter (None: zeros, the base model) into slot `slot` of every adapted
        projection of `state`, in place."""
        flat = dict(state.flat_state())
        arrays = {k: flat[k].value for k in self.keys}
        values = {key: self._slot_value(key, array, adapter) for key, array in arrays.items()}
        if self._program is None:
            self._program = jax.jit(
                lambda arrays, slot, values: {k: a.at[:, slot].set(values[k]) for k, a in arrays.items()},
                donate_argnums=0,
                out_shardings={k: a.sharding for k, a in arrays.items()},
            )
        with jax.set_mesh(self.mesh):
            written = self._program(arrays, np.int32(slot), values)
        for key in self.keys:
            flat[key].value = written[key]

    def _slot_value(self, key: tuple, array: jax.Array, adapter: LoRAAdapter | None) -> np.ndarray:
        """One slot's worth of the array at `key` from the adapter, its rank padded with zeros."""
        weights = adapter.weights if adapter is not None else {}
        copies = getattr(self.args, "kv_head_copies", 1)
        stem, part = str(key[-1]).rsplit("_lora_", 1)
        value = np.zeros((array.shape[0], *array.shape[2:]), np.float32)
        if part == "a":  # [layers, in, projections, rank]: the A of each projection of the group
            for p, name in enumerate(lora_a_members(stem.removesuffix("_proj"))):
                if f"{name}_proj" in weights:
                    a = weights[f"{name}_proj"][0]
                    value[:, :, p, : a.shape[2]] = a
        elif stem in weights and (w := weights[stem][1 if part == "b" else 2]) is not None:
            if stem in KV_PROJECTIONS and copies > 1:  # as the kernels' heads
                w = repeat_kv_heads(w, w.ndim - 1, copies, self.args.head_dim)
            value[tuple(slice(0, n) for n in w.shape)] = w
        return value
