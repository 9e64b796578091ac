"""Converted checkpoints: a model's own parameter tree saved with orbax-checkpoint.

Where it sits: the loader layer, beside safetensors.py and gguf.py. `jaxserve convert` (cli.py)
loads any checkpoint once (renaming, transposing, un-permuting, dequantizing, casting) and
saves the result; `--load-format orbax` (or a directory that looks like one) restores it
straight into each parameter's sharding, with none of that work repeated.

Layout of a converted directory: `config.json` (the HF config the model was built from,
so the registry and the engine read it like any HF directory), the tokenizer files,
`generation_config.json` when the source had one, and the parameters under `orbax/`.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
from flax import nnx

PARAMS_DIR = "orbax"


def is_orbax_dir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, PARAMS_DIR)) and os.path.isfile(os.path.join(path, "config.json"))


def save_converted(
    output: str, state: nnx.State, hf_config: dict, tokenizer, source_dir: str | None, dtype: str
) -> None:
    """Write a converted directory (see the module docstring). Refuses to overwrite."""
    import orbax.checkpoint as ocp

    if os.path.exists(output) and os.listdir(output):
        raise ValueError(f"--output {output} exists and is not empty.")
    os.makedirs(output, exist_ok=True)
    config = {**hf_config, "torch_dtype": dtype}
    with open(os.path.join(output, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(output)
    if source_dir is not None and os.path.isfile(os.path.join(source_dir, "generation_config.json")):
        shutil.copy(os.path.join(source_dir, "generation_config.json"), output)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(os.path.join(output, PARAMS_DIR)), nnx.to_pure_dict(state))


def restore(path: str, abstract: nnx.State, shardings: nnx.State) -> nnx.State:
    """Fill `abstract` (the model's shapes, in the serving dtype) with the saved parameters,
    each restored directly with its sharding."""
    import orbax.checkpoint as ocp

    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nnx.to_pure_dict(abstract),
        nnx.to_pure_dict(shardings),
    )
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            values = checkpointer.restore(os.path.abspath(os.path.join(path, PARAMS_DIR)), target)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise ValueError(f"{path}: the orbax parameters do not fit this model: {e}") from None
    nnx.replace_by_pure_dict(abstract, values)
    return abstract
