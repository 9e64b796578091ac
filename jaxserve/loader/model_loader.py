"""Builds a model's parameters from a checkpoint, straight into their shardings.

Reads HF-named tensors (from safetensors or GGUF, both already in Hugging Face's layout),
maps each onto the model's own parameter tree through the model's weight map, and places
every parameter with the sharding its logical axes ask for. `orbax` restores a converted
directory (loader/orbax.py) without any of that work. `dummy` makes random weights of the
real shapes for benchmarking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.config import ModelConfig, ParallelConfig
from jaxserve.models.registry import resolve_architecture
from jaxserve.sharding import named_sharding, state_shardings


def build_model_args(model_config: ModelConfig, parallel: ParallelConfig | None = None):
    _, entry = resolve_architecture(model_config.hf_config)
    args = entry.make_args(model_config.hf_config, model_config.max_model_len)
    moe = getattr(args, "moe", None)  # expert parallelism means something only to MoE models
    if moe is not None and parallel is not None and parallel.enable_expert_parallel:
        if moe.num_experts % parallel.tensor_parallel_size:
            raise ValueError(
                f"--enable-expert-parallel: {moe.num_experts} experts do not split evenly over "
                f"tensor_parallel_size={parallel.tensor_parallel_size}."
            )
        args = dataclasses.replace(args, moe=dataclasses.replace(moe, expert_parallel=True))
    return entry, args


def _checkpoint_tensors(model_config: ModelConfig) -> Iterable[tuple[str, np.ndarray]]:
    use_tqdm = model_config.use_tqdm_on_load
    if model_config.load_format == "gguf":
        from jaxserve.loader.gguf import iter_gguf_tensors

        return iter_gguf_tensors(model_config.model, use_tqdm=use_tqdm)
    from jaxserve.loader.safetensors import iter_safetensors

    return iter_safetensors(model_config.model, use_tqdm=use_tqdm)


def load_model(
    model_config: ModelConfig, mesh: Mesh, parallel: ParallelConfig | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """Returns the model split once into (graphdef, sharded state)."""
    entry, args = build_model_args(model_config, parallel)
    moe = getattr(args, "moe", None)
    expert_parallel = moe is not None and moe.expert_parallel
    dtype = jnp.dtype(model_config.dtype)
    seed = model_config.seed

    def create():
        return entry.model_cls(args, dtype=dtype, rngs=nnx.Rngs(seed))

    graphdef, abstract = nnx.split(nnx.eval_shape(create))
    if model_config.load_format == "dummy":
        shardings = state_shardings(abstract, mesh, expert_parallel)
        init = jax.jit(lambda: nnx.split(create())[1], out_shardings=shardings)
        return graphdef, init()
    if model_config.load_format == "orbax":
        from jaxserve.loader import orbax

        return graphdef, orbax.restore(
            model_config.model, abstract, state_shardings(abstract, mesh, expert_parallel)
        )

    flat = dict(nnx.to_flat_state(abstract))
    buffers: dict[str, np.ndarray] = {}
    filled: set[str] = set()
    weight_map = entry.model_cls.hf_weight_map(args)
    tensors = _checkpoint_tensors(model_config)
    if entry.split_tensors is not None:
        tensors = (pair for name, t in tensors for pair in entry.split_tensors(name, t, args))
    for name, tensor in tensors:
        if name not in weight_map:
            if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and args.tie_word_embeddings
            ):
                continue
            raise ValueError(f"Checkpoint {model_config.model} has an unexpected tensor {name!r}.")
        path, index, transpose = weight_map[name]  # index: layer, (layer, expert) or None
        index = () if index is None else index if isinstance(index, tuple) else (index,)
        key = tuple(path.split("."))
        target = flat[key].value
        tensor = tensor.T if transpose else tensor
        want = target.shape[len(index) :]
        if tuple(tensor.shape) != tuple(want):
            raise ValueError(
                f"Checkpoint {model_config.model}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(want)}."
            )
        if not index:
            buffers[path] = np.asarray(tensor)
        else:
            buf = buffers.get(path)
            if buf is None:
                buf = buffers[path] = np.empty(target.shape, dtype=tensor.dtype)
            buf[index] = tensor
        filled.add(name)
    missing = sorted(n for n in weight_map if n not in filled)
    if missing:
        raise ValueError(
            f"Checkpoint {model_config.model} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}."
        )
    for key, var in flat.items():
        path = ".".join(map(str, key))
        sharding = named_sharding(mesh, var.get_metadata()["logical_axes"], expert_parallel)
        var.value = jax.device_put(buffers[path].astype(dtype), sharding)
    return graphdef, nnx.from_flat_state(flat)
