"""LoRA adapters in PEFT's layout, read for the Llama-style layers.

A PEFT adapter directory holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules,
bias) and `adapter_model.safetensors` with, per adapted projection of each layer,
`...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight` [r, in] and `lora_B.weight` [out, r]. The
adapted projection computes x W + scaling * (x A^T) B^T, scaling = lora_alpha / r (or
lora_alpha / sqrt(r) with rsLoRA). Read here as, per projection, A [layers, in, r] and B [layers,
r, out] with the scaling folded into B, zero for the layers the adapter leaves alone; the runner
writes them into a device slot padded to --max-lora-rank (zero rows and columns add nothing).
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from jaxserve.layers.linear import LORA_TARGETS
from jaxserve.loader.safetensors import iter_safetensors_file

_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRAAdapter:
    path: str
    rank: int
    # projection -> (A [num_layers, in, rank] float32, B [num_layers, rank, out] float32, scaled)
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


class AdapterCache:
    """Adapters read from disk, by lora_int_id, the `capacity` (--max-cpu-loras) most recently
    used kept in host memory; one read again after its eviction gives the same weights."""

    def __init__(self, capacity: int, args, max_rank: int) -> None:
        self.capacity, self.args, self.max_rank = capacity, args, max_rank
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()  # the server's threads check adapters while the engine loads them

    def get(self, lora_request) -> LoRAAdapter:
        """The request's adapter; ValueError (one line) if it cannot be served."""
        with self._lock:
            return self._get(lora_request)

    def _get(self, lora_request) -> LoRAAdapter:
        key = lora_request.lora_int_id
        adapter = self._adapters.get(key)
        if adapter is not None and adapter.path != lora_request.lora_path:
            raise ValueError(
                f"lora_int_id {key} already names the adapter at {adapter.path}, not {lora_request.lora_path}."
            )
        if adapter is None:
            shapes = projection_shapes(self.args)
            adapter = read_adapter(lora_request.lora_path, self.args.num_layers, shapes, self.max_rank)
            self._adapters[key] = adapter
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        self._adapters.move_to_end(key)
        return adapter


def projection_shapes(args) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection an adapter may adapt, as the checkpoint has them (KV heads
    before any copies for tensor parallelism)."""
    hidden, q = args.hidden_size, args.num_heads * args.head_dim
    kv = args.num_kv_heads // getattr(args, "kv_head_copies", 1) * args.head_dim
    inter = args.intermediate_size
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip


def read_adapter(
    path: str, num_layers: int, shapes: dict[str, tuple[int, int]], max_rank: int
) -> LoRAAdapter:
    """The adapter at `path` for a model of `num_layers` whose projections have `shapes`
    (name -> (in, out)); ValueError (one line) for what cannot be served."""
    config_file = os.path.join(path, "adapter_config.json")
    try:
        with open(config_file) as f:
            config = json.load(f)
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a PEFT LoRA adapter ({err!r}).") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: a {config['peft_type']} adapter, not LoRA.")
    if rank > max_rank:
        raise ValueError(f"{path}: LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: adapters with biases (bias={config['bias']!r}) are not supported yet.")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    weights: dict[str, list[np.ndarray]] = {}
    try:
        tensors = iter_safetensors_file(os.path.join(path, "adapter_model.safetensors"))
        for name, tensor in tensors:
            match = _TENSOR.search(name)
            if match is None:
                raise ValueError(f"{path}: tensor {name!r} adapts nothing jaxserve serves.")
            layer, proj, part = int(match.group(1)), match.group(2), match.group(3)
            if proj not in LORA_TARGETS or proj not in shapes or layer >= num_layers:
                raise ValueError(
                    f"{path}: cannot adapt {proj!r} of layer {layer}; supported: {', '.join(LORA_TARGETS)}."
                )
            d_in, d_out = shapes[proj]
            a, b = weights.setdefault(
                proj,
                [
                    np.zeros((num_layers, d_in, rank), np.float32),
                    np.zeros((num_layers, rank, d_out), np.float32),
                ],
            )
            want = (rank, d_in) if part == "A" else (d_out, rank)
            if tuple(tensor.shape) != want:
                raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, the model needs {want}.")
            if part == "A":
                a[layer] = np.asarray(tensor, np.float32).T
            else:
                b[layer] = np.asarray(tensor, np.float32).T * scaling
    except ValueError as err:
        raise ValueError(str(err).replace("\n", " ")) from None
    if not weights:
        raise ValueError(f"{path}: the adapter holds no LoRA weights.")
    return LoRAAdapter(path, rank, {p: (a, b) for p, (a, b) in weights.items()})
