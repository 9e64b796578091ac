"""LoRA adapters in PEFT's layout, for every family the engine serves.

A PEFT adapter directory holds `adapter_config.json` (r, lora_alpha, use_rslora, fan_in_fan_out,
lora_bias) and `adapter_model.safetensors` with, per adapted module of the base model,
`base_model.model.<module>.lora_A.weight` [r, in], `lora_B.weight` [out, r] and, with PEFT's
lora_bias, `lora_B.bias` [out]. The adapted module computes its own output + scaling * (B (A x)
+ bias), scaling = lora_alpha / r (or lora_alpha / sqrt(r) with rsLoRA).

The adapter is read through the model's own checkpoint map: B (and its bias) goes through the
family's tensor renaming and splitting as if it were the module's weight with r inputs, so a
fused module (Phi-3's qkv_proj / gate_up_proj, GPT-2's c_attn) yields one B per projection the
model computes, all sharing the module's A (GPT-2's Conv1D weights are stored [in, out]: PEFT's
fan_in_fan_out; B is handed over the same way). Read here as, per projection, A [layers, in, r]
and B [layers, r, out] with the scaling folded into B (and the bias [layers, out], scaled), zero
for the layers the adapter leaves alone; the runner writes them into a device slot padded to
--max-lora-rank (zero rows and columns add nothing).
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.loader.safetensors import iter_safetensors_file

_TENSOR = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_(A\.weight|B\.weight|B\.bias)$")
_PARTS = {"A.weight": "A", "B.weight": "B", "B.bias": "bias"}


@dataclass(frozen=True)
class AdapterSpec:
    """What a served model's LoRA slots take: built by the runner from its model."""

    num_layers: int
    # projection (our name, e.g. "q_proj") -> (in, out), as the checkpoint has it (KV heads
    # before any copies for tensor parallelism): the projections that have slots
    shapes: dict[str, tuple[int, int]]
    # the family's checkpoint map: HF name -> (our parameter path, index, transpose?)
    weight_map: dict[str, tuple[str, Any, bool]]
    # the family's renaming / splitting of checkpoint tensors (None: names as they are)
    split_tensors: Callable[[str, np.ndarray, Any], Iterator[tuple[str, np.ndarray]]] | None
    args: Any  # the model's args, for split_tensors
    max_rank: int
    bias: bool  # --enable-lora-bias


@dataclass(frozen=True)
class LoRAAdapter:
    path: str
    rank: int
    # projection -> (A [num_layers, in, rank], B [num_layers, rank, out] scaled, bias [num_layers,
    # out] scaled or None), float32
    weights: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]


class AdapterCache:
    """Adapters read from disk, by lora_int_id, the `capacity` (--max-cpu-loras) most recently
    used kept in host memory; one read again after its eviction gives the same weights."""

    def __init__(self, capacity: int, spec: AdapterSpec) -> None:
        self.capacity, self.spec = capacity, spec
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
            adapter = read_adapter(lora_request.lora_path, self.spec)
            self._adapters[key] = adapter
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        self._adapters.move_to_end(key)
        return adapter


def read_adapter(path: str, spec: AdapterSpec) -> LoRAAdapter:
    """The adapter at `path` for the model `spec` describes; ValueError (one line) for what
    cannot be served."""
    config_file = os.path.join(path, "adapter_config.json")
    try:
        with open(config_file) as f:
            config = json.load(f)
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a PEFT LoRA adapter ({err!r}).") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: a {config['peft_type']} adapter, not LoRA.")
    if rank > spec.max_rank:
        raise ValueError(f"{path}: LoRA rank {rank} is greater than max_lora_rank {spec.max_rank}.")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"{path}: adapters that retrain the base model's biases (bias={config['bias']!r}) are not "
            "supported; LoRA biases (lora_bias) are, with --enable-lora-bias."
        )
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    try:
        modules: dict[str, dict[str, np.ndarray]] = {}
        for name, tensor in iter_safetensors_file(os.path.join(path, "adapter_model.safetensors")):
            match = _TENSOR.match(name)
            if match is None:
                raise ValueError(f"{path}: tensor {name!r} adapts nothing jaxserve serves.")
            module, part = match.groups()
            modules.setdefault(module, {})[_PARTS[part]] = np.asarray(tensor, np.float32)
        weights: dict[str, list] = {}
        for module, parts in modules.items():
            for proj, layer, a, b, bias in _projections(path, module, parts, rank, config, spec):
                d_in, d_out = spec.shapes[proj]
                if a.shape != (rank, d_in) or b.shape != (d_out, rank):
                    raise ValueError(
                        f"{path}: {module} has A {a.shape} and B {b.shape}, the model needs "
                        f"{(rank, d_in)} and {(d_out, rank)}."
                    )
                entry = weights.setdefault(
                    proj,
                    [
                        np.zeros((spec.num_layers, d_in, rank), np.float32),
                        np.zeros((spec.num_layers, rank, d_out), np.float32),
                        np.zeros((spec.num_layers, d_out), np.float32) if spec.bias else None,
                    ],
                )
                entry[0][layer], entry[1][layer] = a.T, b.T * scaling
                if bias is not None:
                    entry[2][layer] = bias * scaling
    except ValueError as err:
        raise ValueError(str(err).replace("\n", " ")) from None
    if not weights:
        raise ValueError(f"{path}: the adapter holds no LoRA weights.")
    return LoRAAdapter(path, rank, {p: tuple(w) for p, w in weights.items()})


def _projections(path: str, module: str, parts: dict, rank: int, config: dict, spec: AdapterSpec):
    """(projection, layer, A [r, in], B [out, r], bias [out] or None) for each projection one
    adapted module of the checkpoint feeds."""
    if "A" not in parts or "B" not in parts:
        raise ValueError(f"{path}: {module} has no {'lora_A' if 'A' not in parts else 'lora_B'}.weight.")
    if "bias" in parts and not spec.bias:
        raise ValueError(f"{path}: {module} has a LoRA bias; serve it with --enable-lora-bias.")
    a, b = parts["A"], parts["B"]
    if b.ndim != 2:
        raise ValueError(f"{path}: {module}.lora_B.weight has shape {b.shape}.")
    split = spec.split_tensors or (lambda name, tensor, args: iter([(name, tensor)]))
    # B as the checkpoint stores the module's weight: [out, r], or [r, out] for fan_in_fan_out
    pieces = list(split(f"{module}.weight", b.T if config.get("fan_in_fan_out") else b, spec.args))
    biases = dict(split(f"{module}.bias", parts["bias"], spec.args)) if "bias" in parts else {}
    for name, piece in pieces:
        target = spec.weight_map.get(name)
        proj = target[0].removeprefix("layers.") if target else None
        if proj not in spec.shapes or not isinstance(target[1], int) or not target[2]:
            raise ValueError(
                f"{path}: cannot adapt {module!r}; LoRA is served on the decoder layers' attention and "
                "dense MLP projections."
            )
        yield proj, target[1], a, piece, biases.get(name.removesuffix(".weight") + ".bias")
