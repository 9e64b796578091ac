"""A model's generation_config.json: the sampling defaults its authors chose.

With `--generation-config auto` (vLLM's default) they become the defaults of requests
that leave a field out; `vllm` ignores the file; a directory path reads the file from
there. `--override-generation-config` is merged on top either way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

GENERATION_CONFIG_FILE = "generation_config.json"

# generation_config.json key -> SamplingParams field
SAMPLING_DEFAULT_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
    "repetition_penalty": "repetition_penalty",
}


def read_generation_config(model_path: str, generation_config: str) -> dict:
    """The raw generation config ({} when there is none or when asked to ignore it)."""
    if generation_config == "vllm":
        return {}
    directory = model_path if generation_config == "auto" else generation_config
    if os.path.isfile(directory):  # a .gguf file carries no generation config
        return {}
    path = os.path.join(directory, GENERATION_CONFIG_FILE)
    if not os.path.exists(path):
        if generation_config != "auto":
            raise ValueError(f"generation_config {generation_config!r} has no {GENERATION_CONFIG_FILE}.")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable JSON file: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    return data


def sampling_defaults(raw: Mapping, overrides: Mapping) -> dict:
    """SamplingParams keyword defaults from a generation config plus overrides."""
    merged = {**raw, **overrides}
    if not raw.get("do_sample", True) and "temperature" not in overrides:
        merged["temperature"] = 0.0  # the authors ask for greedy decoding
    return {field: merged[key] for key, field in SAMPLING_DEFAULT_KEYS.items() if key in merged}
