"""The scales of a quantized KV cache (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2 / int8).

A quantized pool stores each layer's keys as k / k_scale and values as v / v_scale (one scale
per layer for each, per-tensor), in int8 or fp8; attention folds the scales back in
(pallas_kernels/ragged_paged_attention/reference.py, "Quantized pages"). The scales are an array
[num_layers, 2] (key, value) fixed at start-up, from one of:

- `--quantization-param-path FILE`: vLLM's kv_cache_scales JSON, one scale per layer for keys and
  values alike, given per tensor-parallel rank
  ({"model_type": ..., "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.02,
  ...}}}}). jaxserve keeps one scale per layer for all its shards: the largest of the ranks', so
  no rank's values saturate earlier than its own scale allowed.
- `--calculate-kv-scales`, and int8 given no file: measured at start-up. The model runs over a
  fixed calibration text with a float32 pool (one extra compile), and each layer's scale is the
  largest |k| (|v|) it wrote, times a headroom, over the format's largest value. A fixed text,
  not the first request: every start, process and replica gets the same scales, so outputs are
  reproducible and pages cached under one scale are never read under another.
- else 1.0 (fp8's range reaches 448 for e4m3 and 57344 for e5m2, beyond most keys and values).
"""

from __future__ import annotations

import json
import logging
import math
import os

import numpy as np

from pallas_kernels import native

logger = logging.getLogger(__name__)

# amax over the largest representable value, per format: where the calibration text's largest
# |k| or |v| lands. fp8's precision is relative, so headroom against larger values in real
# prompts costs nothing there; int8's is absolute, so its headroom is smaller.
HEADROOM = {"int8": 1.25, "fp8": 2.0}

# The calibration text: a little of everything a server sees (a chat turn, prose, code,
# figures), written for this purpose.
CALIBRATION_TEXT = """\
User: Can you explain how a hash table works, and when I should use one?
Assistant: A hash table stores values under keys. It runs each key through a hash function,
which turns it into a number, and uses that number to pick a slot in an array. Looking a key
up repeats the same steps, so on average it takes the same short time however many entries
the table holds. Two keys can land in the same slot; the table then keeps a short list there,
or probes the next free slot. Use one when you look things up by name far more often than you
walk through them in order.

def count_words(text):
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda item: -item[1])[:10]

The committee met on 14 March 2024 and approved a budget of $2.75 million, an increase of 12%
over the previous year. Of that, 40% goes to maintenance, 35% to new equipment and the rest to
training. Le comité se réunira de nouveau en septembre. 会议将在九月再次举行。
Q: What is 17 * 23? A: 17 * 23 = 391, since 17 * 20 = 340 and 17 * 3 = 51.
The old lighthouse stood at the end of the harbour wall, its lamp long since replaced by an
automatic beacon, and on calm evenings the keeper's grandchildren still climbed the stairs to
watch the fishing boats come home.
"""


def initial_scales(config, num_layers: int, dtype_name: str, platform: str) -> np.ndarray:
    """[num_layers, 2] scales of a pool of `dtype_name` pages before any are measured: the
    file's, an fp8 checkpoint's own (unless --calculate-kv-scales measures them instead), else 1.0."""
    cc, mc = config.cache_config, config.model_config
    fp8 = dtype_name.startswith("float8")
    if fp8 and platform == "cpu" and not native.load():  # (the native write is in place)
        logger.warning(  # measured in benchmarks/quantization.py
            "fp8 KV pages are written through copies of the whole pool on a CPU without the native "
            "kernels (XLA:CPU has no fp8 scatter): every step is many times slower; "
            "--kv-cache-dtype int8 is the CPU's choice."
        )
    if cc.quantization_param_path:
        return read_scales_file(cc.quantization_param_path, num_layers, dtype_name, mc.get("model_type"))
    if fp8 and mc.checkpoint_quantization and not cc.calculate_kv_scales:
        from jaxserve.loader.prequantized import checkpoint_kv_scales

        found = checkpoint_kv_scales(mc.model, num_layers)
        if found is not None:
            return found
    return np.ones((num_layers, 2), np.float32)


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """The calibration text's token ids; without a tokenizer (--skip-tokenizer-init), 512 ids
    drawn with a fixed seed: a poorer sample of real activations, but the same on every start."""
    if tokenizer is not None:
        return tokenizer.encode(CALIBRATION_TEXT)
    return np.random.default_rng(0).integers(0, vocab_size, 512).tolist()


def measured_at_startup(cache_config) -> bool:
    """Whether the scales are measured at start-up: asked for, or int8 pages given no file."""
    if cache_config.cache_dtype == "auto" or cache_config.quantization_param_path:
        return False
    return cache_config.calculate_kv_scales or cache_config.cache_dtype == "int8"


def largest(dtype_name: str) -> float:
    """The largest value a page of this dtype holds (int8: 127, symmetric)."""
    import jax.numpy as jnp

    if dtype_name == "int8":
        return 127.0
    return float(jnp.finfo(jnp.dtype(dtype_name)).max)


def scales_from_amax(amax: np.ndarray, dtype_name: str) -> np.ndarray:
    """[num_layers, 2] largest |k|, |v| per layer -> their scales in `dtype_name` pages."""
    headroom = HEADROOM["int8" if dtype_name == "int8" else "fp8"]
    scales = np.asarray(amax, np.float64) * headroom / largest(dtype_name)
    # A layer that wrote only zeros (or nothing) keeps scale 1: any scale stores zeros exactly.
    return np.where(scales > 0, scales, 1.0).astype(np.float32)


def read_scales_file(path: str, num_layers: int, dtype_name: str, model_type: str | None) -> np.ndarray:
    """vLLM's kv_cache_scales JSON -> [num_layers, 2] float32 (each layer's scale for keys and
    values). ValueError (one line) naming what is wrong with the file."""
    try:
        with open(os.path.expanduser(path)) as f:
            data = json.load(f)
        ranks = data["kv_cache"]["scaling_factor"]
        file_dtype = data["kv_cache"].get("dtype")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"--quantization-param-path {path}: not a KV-scales file ({err!r}); expected "
            '{"kv_cache": {"dtype": ..., "scaling_factor": {"<tp rank>": {"<layer>": scale}}}}.'
        ) from None
    if (
        file_dtype is not None
        and file_dtype != dtype_name
        and not (dtype_name.startswith("float8") and file_dtype.startswith("float8"))
    ):
        raise ValueError(
            f"--quantization-param-path {path}: the scales are for {file_dtype} pages, the KV cache is {dtype_name}."
        )
    if model_type and data.get("model_type") and data["model_type"] != model_type:
        raise ValueError(
            f"--quantization-param-path {path}: the scales are for a {data['model_type']} model, not {model_type}."
        )
    if not isinstance(ranks, dict) or not ranks:
        raise ValueError(f"--quantization-param-path {path}: scaling_factor names no tensor-parallel rank.")
    scale = np.zeros(num_layers, np.float64)
    for rank, layers in ranks.items():
        try:
            per_layer = {int(layer): float(value) for layer, value in layers.items()}
        except (AttributeError, ValueError, TypeError):
            raise ValueError(
                f"--quantization-param-path {path}: rank {rank}'s scales are not {{layer: number}}."
            ) from None
        missing = sorted(set(range(num_layers)) - set(per_layer))
        if missing:
            raise ValueError(
                f"--quantization-param-path {path}: rank {rank} has no scale for layer(s) {missing[:5]} "
                f"of the model's {num_layers}."
            )
        values = np.asarray([per_layer[i] for i in range(num_layers)])
        if not all(math.isfinite(x) and x > 0 for x in values):
            raise ValueError(
                f"--quantization-param-path {path}: rank {rank} has a scale that is not a positive number."
            )
        scale = np.maximum(scale, values)
    return np.repeat(scale[:, None], 2, axis=1).astype(np.float32)
