"""Checkpoints quantized by other tools, served from their own int8 or fp8 values.

Two ways of writing them are read, from config.json's `quantization_config`:
- `quant_method: fp8` (vLLM's Fp8Config, transformers' FineGrainedFP8): float8_e4m3fn weights
  with a per-tensor `weight_scale`, or, given `weight_block_size` [rows, cols], a
  `weight_scale_inv` per block of rows x cols (multiplied in, despite its name);
- `quant_method: compressed-tensors` (llm-compressor) in the `float-quantized`, `int-quantized`
  or `naive-quantized` formats: 8-bit symmetric weights (float8_e4m3fn or int8) with a
  `weight_scale` per tensor, per output channel, per group of inputs or per block.
Either way w = values * scale. Activation quantization (an `input_scale`, dynamic per-token
schemes) is not applied: the activations stay in the model's dtype, as in the weight-only
schemes, which is at least as accurate.

Each projection (q/k/v/o/gate/up/down of the Llama-style layers) whose values and scales every
layer stores alike is served as it is stored: one scale per output channel ("fp8", "int8": a
per-tensor scale repeated, a block's rows repeated over its rows when it spans all inputs), or
one per group of inputs and output channel ("fp8/128", "int8/32": a block's scale repeated over
its rows); see layers/linear.py. Any other quantized tensor (another family's layout, a
projection quantized differently from layer to layer, blocks that do not divide the inputs) is
dequantized at load to the model's dtype, exactly.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from jaxserve.loader.gguf_blocks import GroupQuantized
from jaxserve.loader.safetensors import iter_safetensors, read_headers

logger = logging.getLogger(__name__)

METHODS = ("fp8", "compressed-tensors")
COMPRESSED_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")
SCALE_SUFFIXES = ("_scale", "_scale_inv")  # after "weight"
# Tensors of the quantization that the weights do not need: activation and output scales, and
# the KV cache's (read by the runner for --kv-cache-dtype fp8, see checkpoint_kv_scales).
DROPPED = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".kv_scale")
_LAYER_PROJECTION = re.compile(r"^model\.layers\.(\d+)\.((?:self_attn|mlp)\.[a-z_]+_proj)\.weight$")


@dataclass(frozen=True)
class CheckpointScheme:
    method: str  # a METHODS entry
    weights: str  # "fp8" or "int8"
    activations: bool  # the checkpoint also quantizes activations (not applied here)


def checkpoint_scheme(quantization_config: Mapping) -> CheckpointScheme:
    """What a quantization_config holds; ValueError (one line) naming what jaxserve cannot read."""
    method = quantization_config.get("quant_method")
    if method == "fp8":
        return CheckpointScheme("fp8", "fp8", quantization_config.get("activation_scheme") == "static")
    if method != "compressed-tensors":
        raise ValueError(
            f"quantization method {method!r} is not one jaxserve reads; supported: {', '.join(METHODS)}."
        )
    fmt = quantization_config.get("format")
    if fmt not in COMPRESSED_FORMATS:
        raise ValueError(
            f"compressed-tensors format {fmt!r} is not one jaxserve reads; supported: {', '.join(COMPRESSED_FORMATS)}."
        )
    groups = list((quantization_config.get("config_groups") or {}).values())
    if len(groups) != 1 or not isinstance(groups[0].get("weights"), Mapping):
        raise ValueError(
            "compressed-tensors checkpoints with other than one weight scheme are not supported."
        )
    weights = groups[0]["weights"]
    kind = weights.get("type")
    if weights.get("num_bits") != 8 or kind not in ("int", "float"):
        raise ValueError(
            f"compressed-tensors weights of {weights.get('num_bits')} bits ({kind}) are not supported; "
            "supported: 8-bit int or float."
        )
    if not weights.get("symmetric", True):
        raise ValueError("compressed-tensors weights with zero points (asymmetric) are not supported.")
    return CheckpointScheme(
        "compressed-tensors", "fp8" if kind == "float" else "int8", bool(groups[0].get("input_activations"))
    )


def _scale_name(weight: str, names) -> str | None:
    return next((weight + s for s in SCALE_SUFFIXES if weight + s in names), None)


def _layout(values_shape: tuple[int, ...], scale_shape: tuple[int, ...], weights: str) -> str | None:
    """How values [out, in] with a scale of `scale_shape` are served: "fp8"/"int8" (one scale per
    output channel), "fp8/N"/"int8/N" (per group of N inputs too), or None (dequantized)."""
    _, d_in = values_shape
    cols = scale_shape[1] if len(scale_shape) == 2 else 1
    if cols == 1:
        return weights
    return f"{weights}/{d_in // cols}" if d_in % cols == 0 else None


def kernel_formats(model_dir: str, scheme: CheckpointScheme) -> dict[str, str]:
    """HF projection names (``self_attn.q_proj`` ...) stored quantized the same way in every
    layer -> the format they are served in (see _layout)."""
    headers = read_headers(model_dir)
    seen: dict[str, set[str | None]] = {}
    for name, (dtype, shape) in headers.items():
        match = _LAYER_PROJECTION.match(name)
        if match is None:
            continue
        scale = _scale_name(name, headers)
        fmt = None
        if dtype.itemsize == 1 and scale is not None and len(shape) == 2:
            fmt = _layout(shape, headers[scale][1], scheme.weights)
        seen.setdefault(match.group(2), set()).add(fmt)
    return {name: fmts.pop() for name, fmts in seen.items() if len(fmts) == 1 and None not in fmts}


def _expand(scale: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A scale of any layout -> [out, in / group] (group: inputs per scale), float32."""
    out, _ = shape
    scale = np.asarray(scale, np.float32).reshape((1, 1) if scale.size == 1 else (scale.shape[0], -1))
    return np.repeat(scale, -(-out // scale.shape[0]), axis=0)[:out]


def dequantize(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """values [out, in] times their scale (per tensor, channel, group or block) -> float32."""
    out, d_in = values.shape
    per_row = _expand(scale, values.shape)
    per_value = np.repeat(per_row, -(-d_in // per_row.shape[1]), axis=1)[:, :d_in]
    return values.astype(np.float32) * per_value


def prequantized_tensors(
    model_dir: str, formats: Mapping[str, str], use_tqdm: bool = True
) -> Iterator[tuple[str, np.ndarray | GroupQuantized]]:
    """Every tensor the model needs, as iter_safetensors yields them: the projections `formats`
    names (``q_proj`` ...) as GroupQuantized (values [out, in] as stored, float32 scales [out] or [out,
    in / group]), every other quantized weight dequantized to float32. The scales (small) are
    read first, so each weight meets its scale wherever the file put it."""
    headers = read_headers(model_dir)
    scale_names = {
        _scale_name(n, headers)
        for n, (dtype, _) in headers.items()
        if n.endswith(".weight") and dtype.itemsize == 1
    } - {None}
    scales = dict(iter_safetensors(model_dir, use_tqdm=False, select=scale_names.__contains__))
    weights = iter_safetensors(
        model_dir, use_tqdm, select=lambda n: n not in scale_names and not n.endswith(DROPPED)
    )
    for name, tensor in weights:
        scale_name = _scale_name(name, scales)
        if scale_name is None or tensor.itemsize != 1:
            yield name, tensor
            continue
        match = _LAYER_PROJECTION.match(name)
        if match is not None and match.group(2).split(".")[-1] in formats:
            scale = _expand(scales[scale_name], tensor.shape)
            yield name, GroupQuantized(tensor, scale[:, 0] if scale.shape[1] == 1 else scale, None)
        else:
            yield name, dequantize(tensor, scales[scale_name])


def checkpoint_kv_scales(model_dir: str, num_layers: int) -> np.ndarray | None:
    """[num_layers, 2] float32: the key and value scales an fp8 checkpoint stores for its KV
    cache (``...self_attn.k_scale`` / ``v_scale``, or one ``kv_scale`` for both), or None."""
    pattern = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:[a-z_]+\.)?(k_scale|v_scale|kv_scale)$")
    found = {}
    for name, tensor in iter_safetensors(model_dir, use_tqdm=False, select=lambda n: bool(pattern.match(n))):
        layer, kind = pattern.match(name).groups()
        found[int(layer), kind] = float(np.asarray(tensor, np.float32).max())
    if not found:
        return None
    scales = np.ones((num_layers, 2), np.float32)
    for (layer, kind), value in found.items():
        if layer < num_layers:
            columns = {"k_scale": [0], "v_scale": [1], "kv_scale": [0, 1]}[kind]
            scales[layer, columns] = value
    return scales
