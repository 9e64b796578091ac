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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import LoRAConfig, ModelConfig, ParallelConfig
from jaxserve.layers.linear import (
    LLAMA_PROJECTIONS,
    MIN_SUFFIX,
    SCALE_SUFFIX,
    group_rows,
    pack_q4,
    quantize_kernel,
)
from jaxserve.loader import file_cache
from jaxserve.models.registry import resolve_architecture
from jaxserve.sharding import named_sharding, state_shardings


def build_model_args(
    model_config: ModelConfig, parallel: ParallelConfig | None = None, lora: LoRAConfig | None = None
):
    _, entry = resolve_architecture(model_config.hf_config)
    args = entry.make_args(model_config.hf_config, model_config.max_model_len)
    tp = parallel.tensor_parallel_size if parallel is not None else 1
    if lora is not None:
        if lora.fully_sharded and lora.max_lora_rank % tp:
            raise ValueError(
                f"--fully-sharded-loras splits the LoRA rank over the devices: max_lora_rank "
                f"({lora.max_lora_rank}) must be a multiple of tensor_parallel_size ({tp})."
            )
        args = dataclasses.replace(args, lora=lora)
    if model_config.runner_type == "pooling":  # pooling reads the final hidden states: no LM head
        args = dataclasses.replace(args, tie_word_embeddings=True)
        pooler = model_config.pooler_config
        if pooler.labels:  # a score head over them instead (a classifier's, a reward model's)
            if pooler.task == "reward" and not hasattr(args, "reward_hidden_layer"):
                raise ValueError(
                    f"{type(args).__name__[:-4]} models are not served as reward models by jaxserve."
                )
            args = dataclasses.replace(args, num_labels=len(pooler.labels))
        if pooler.reward_hidden_layer:
            args = dataclasses.replace(args, reward_hidden_layer=True)
    formats = checkpoint_kernel_formats(model_config, args)
    if formats:  # projections served in the checkpoint's own quantized values
        formats = {hf.split(".")[-1]: fmt for hf, fmt in formats.items()}
        # the projections split by input under tensor parallelism: whole groups (4 bits: pairs) each
        split_inputs = {"o_proj": args.num_heads * args.head_dim, "down_proj": args.intermediate_size}
        for name, inputs in split_inputs.items():
            rows = group_rows(formats.get(name))
            if rows and (inputs // rows) % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} does not split the quantization groups of {name} ({inputs} "
                    f"inputs, {inputs // rows} groups of {rows}); serve the checkpoint dequantized (a GGUF "
                    "file with --quantization none) or with another tensor_parallel_size."
                )
        args = dataclasses.replace(args, kernel_formats=tuple(sorted(formats.items())))
    elif model_config.quantization not in (None, "gguf"):  # the layers' projections quantized at load
        args = dataclasses.replace(args, quantization=model_config.quantization)
    vision = getattr(args, "vision", None)  # a vision encoder splits like the decoder where it can
    if vision is not None and tp > 1 and not (vision.num_heads % tp or vision.intermediate_size % tp):
        args = dataclasses.replace(args, vision=dataclasses.replace(vision, tp_split=True))
    moe = getattr(args, "moe", None)  # expert parallelism means something only to MoE models
    if moe is not None and parallel is not None and parallel.enable_expert_parallel:
        if moe.num_experts % tp:
            raise ValueError(
                f"--enable-expert-parallel: {moe.num_experts} experts do not split evenly over "
                f"tensor_parallel_size={tp}."
            )
        args = dataclasses.replace(args, moe=dataclasses.replace(moe, expert_parallel=True))
    quantized_table = dict(getattr(args, "kernel_formats", ())).get("embed_tokens")
    if args.vocab_size % tp and model_config.runner_type == "pooling" and not quantized_table:
        # no LM head: zero rows that no token reads split the embedding table evenly
        args = dataclasses.replace(args, vocab_size=-(-args.vocab_size // tp) * tp)
    if args.vocab_size % tp:
        raise ValueError(
            f"vocab_size ({args.vocab_size}) must be divisible by tensor_parallel_size ({tp}): the "
            "embedding and the LM head are split by vocabulary rows (padding is not implemented)."
        )
    if args.num_heads % tp:
        raise ValueError(
            f"Total number of attention heads ({args.num_heads}) must be divisible by "
            f"tensor_parallel_size ({tp})."
        )
    if args.num_kv_heads < tp:  # each device needs a whole KV head: store copies (as vLLM does)
        if tp % args.num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size ({tp}) must be a multiple of the number of KV heads "
                f"({args.num_kv_heads}) when it exceeds it."
            )
        args = dataclasses.replace(args, num_kv_heads=tp, kv_head_copies=tp // args.num_kv_heads)
    elif args.num_kv_heads % tp:
        raise ValueError(
            f"Total number of KV heads ({args.num_kv_heads}) must be divisible by tensor_parallel_size ({tp})."
        )
    return entry, args


def checkpoint_kernel_formats(model_config: ModelConfig, args) -> dict[str, str]:
    """HF projection names (``self_attn.q_proj``) -> the format the checkpoint's own quantized
    values are served in (layers/linear.py): a GGUF file's groups, a converted checkpoint's, or
    a pre-quantized checkpoint's int8 / fp8 values; {} for a model in float."""
    if not hasattr(args, "kernel_formats"):  # (families without Llama-style layers: dequantized)
        return {}
    if model_config.quantization == "gguf":
        from jaxserve.loader.gguf import gguf_kernel_formats

        saved = (model_config.get("quantization_config") or {}).get("kernel_formats")  # converted
        return saved if saved is not None else gguf_kernel_formats(model_config.model)
    if model_config.checkpoint_quantization is not None:
        from jaxserve.loader.prequantized import checkpoint_scheme, kernel_formats

        scheme = checkpoint_scheme(model_config.get("quantization_config"))
        return {
            k: f
            for k, f in kernel_formats(model_config.model, scheme).items()
            if k.split(".")[-1] in LLAMA_PROJECTIONS
        }
    return {}


def repeat_kv_heads(tensor, axis: int, copies: int, head_dim: int):
    """Each head_dim-sized block along `axis` repeated `copies` times in place (head j becomes
    heads j*copies .. j*copies+copies-1), so query head h still reads KV head h // group."""
    if copies == 1:
        return tensor
    xp = np if isinstance(tensor, np.ndarray) else jnp
    shape = tensor.shape
    heads = tensor.reshape(*shape[:axis], shape[axis] // head_dim, head_dim, *shape[axis + 1 :])
    return xp.repeat(heads, copies, axis=axis).reshape(
        *shape[:axis], shape[axis] * copies, *shape[axis + 1 :]
    )


def _kv_axis(var) -> int | None:
    axes = var.get_metadata().get("logical_axes") or ()
    return axes.index("kv_heads") if "kv_heads" in axes else None


def _checkpoint_tensors(model_config: ModelConfig, args) -> Iterable[tuple[str, np.ndarray]]:
    use_tqdm = model_config.use_tqdm_on_load
    if model_config.checkpoint_quantization is not None:
        from jaxserve.loader.prequantized import prequantized_tensors

        return prequantized_tensors(model_config.model, dict(args.kernel_formats), use_tqdm=use_tqdm)
    if model_config.load_format == "gguf":
        from jaxserve.loader.gguf import gguf_kernel_formats, iter_gguf_tensors

        grouped = (
            frozenset(gguf_kernel_formats(model_config.model))
            if getattr(args, "kernel_formats", ())
            else frozenset()
        )
        return iter_gguf_tensors(model_config.model, use_tqdm=use_tqdm, grouped=grouped)
    from jaxserve.loader.safetensors import iter_safetensors

    return iter_safetensors(model_config.model, use_tqdm=use_tqdm)


def load_model(
    model_config: ModelConfig,
    mesh: Mesh,
    parallel: ParallelConfig | None = None,
    lora: LoRAConfig | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """Returns the model split once into (graphdef, sharded state); with `lora`, the state holds
    the LoRA slots too, all zero (the base model) until the runner writes adapters into them."""
    graphdef, state = _load_model(model_config, mesh, parallel)
    if lora is None:
        return graphdef, state
    graphdef, abstract = abstract_model(model_config, mesh, parallel, lora)
    loaded, flat = dict(nnx.to_flat_state(state)), dict(nnx.to_flat_state(abstract))
    for key, var in flat.items():
        if key in loaded:
            var.value = loaded[key].value
        else:  # a LoRA slot
            s = var.value
            var.value = jax.jit(lambda s=s: jnp.zeros(s.shape, s.dtype), out_shardings=s.sharding)()
    return graphdef, nnx.from_flat_state(flat)


def abstract_model(
    model_config: ModelConfig,
    mesh: Mesh,
    parallel: ParallelConfig | None = None,
    lora: LoRAConfig | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """What load_model returns, without reading a weight: every parameter a ShapeDtypeStruct with
    the sharding load_model would place it with (how a step is compiled for devices this process
    cannot run on, or for a model whose weights are not here)."""
    entry, args = build_model_args(model_config, parallel, lora)
    moe = getattr(args, "moe", None)
    expert_parallel = moe is not None and moe.expert_parallel
    dtype = jnp.dtype(model_config.dtype)
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: entry.model_cls(args, dtype=dtype, rngs=nnx.Rngs(0)))
    )
    flat = dict(nnx.to_flat_state(abstract))
    for var in flat.values():
        sharding = named_sharding(mesh, var.get_metadata()["logical_axes"], expert_parallel)
        var.value = jax.ShapeDtypeStruct(var.value.shape, var.value.dtype, sharding=sharding)
    return graphdef, nnx.from_flat_state(flat)


def _load_model(
    model_config: ModelConfig, mesh: Mesh, parallel: ParallelConfig | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
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
        return graphdef, _restore_orbax(model_config, entry, args, abstract, mesh, expert_parallel)

    flat = dict(nnx.to_flat_state(abstract))
    values = {".".join(map(str, key)): var.value for key, var in flat.items()}
    # kernels to quantize here, per output channel (a file's own groups are read as they are)
    quantized = {
        p.removesuffix(SCALE_SUFFIX)
        for p, v in values.items()
        if p.endswith(SCALE_SUFFIX)
        and v.ndim == values[p.removesuffix(SCALE_SUFFIX)].ndim - 1
        and p.split(".")[-1].removesuffix(SCALE_SUFFIX) not in dict(getattr(args, "kernel_formats", ()))
    }
    paths = set(values) - {p + SCALE_SUFFIX for p in quantized}  # (made below, not read)
    buffers = None
    if model_config.load_format == "gguf":  # dequantized and stacked once, then read back mapped
        grouped = "-groups" if getattr(args, "kernel_formats", ()) else ""
        cached_as = f"weights-kv{getattr(args, 'kv_head_copies', 1)}{grouped}"
        buffers = file_cache.read_arrays(model_config.model, cached_as, paths)
    if buffers is None:
        buffers = _read_buffers(model_config, entry, args, flat)
        if model_config.load_format == "gguf":
            file_cache.write_arrays(model_config.model, cached_as, buffers)
    for path in quantized:
        buffers[path], buffers[path + SCALE_SUFFIX] = quantize_kernel(buffers[path], args.quantization)
    for key, var in flat.items():
        buf = buffers[".".join(map(str, key))]
        sharding = named_sharding(mesh, var.get_metadata()["logical_axes"], expert_parallel)
        # Each device receives only its own slice, cast on the host: no device (and, across
        # hosts, no process) ever holds a whole tensor it does not own.
        var.value = jax.make_array_from_callback(
            buf.shape, sharding, lambda i, b=buf, t=var.value.dtype: b[i].astype(t, copy=False)
        )
    return graphdef, nnx.from_flat_state(flat)


def _read_buffers(model_config: ModelConfig, entry, args, flat: dict) -> dict[str, np.ndarray]:
    """Every parameter as one host array (layers stacked), by dotted parameter path."""
    from jaxserve.loader.gguf_blocks import GroupQuantized

    copies = getattr(args, "kv_head_copies", 1)
    buffers: dict[str, np.ndarray] = {}
    filled: set[str] = set()
    weight_map = entry.model_cls.hf_weight_map(args)
    tensors = _checkpoint_tensors(model_config, args)
    if entry.split_tensors is not None:
        tensors = (pair for name, t in tensors for pair in entry.split_tensors(name, t, args))
    pooler = model_config.pooler_config
    if pooler is not None and (pooler.classifier_tokens or pooler.score_token_ids):
        tensors = _score_from_lm_head(tensors, model_config, args)
    for name, tensor in tensors:
        if name not in weight_map and "model." + name in weight_map:  # a base model's (Qwen3Model)
            name = "model." + name
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
        if isinstance(tensor, GroupQuantized):  # kept in its groups: stacked, then packed below
            _stack_groups(
                buffers,
                path,
                index,
                tensor.map(lambda a: a.T) if transpose else tensor,
                target,
                copies if _kv_axis(flat[key]) is not None else 1,
                args.head_dim,
            )
            filled.add(name)
            continue
        tensor = tensor.T if transpose else tensor
        kv_axis = _kv_axis(flat[key])
        if kv_axis is not None:
            tensor = repeat_kv_heads(tensor, kv_axis - len(index), copies, args.head_dim)
        want = target.shape[len(index) :]
        if path == "embed_tokens" and tensor.shape[0] < want[0]:  # a pooling model's padded table
            tensor = np.pad(np.asarray(tensor), [(0, want[0] - tensor.shape[0]), (0, 0)])
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
    for path in [p for p in buffers if p.endswith(MIN_SUFFIX)]:  # 4-bit groups: two values a byte
        kernel = path.removesuffix(MIN_SUFFIX)
        parts = (buffers[kernel], buffers[kernel + SCALE_SUFFIX], buffers[path])
        buffers[kernel], buffers[kernel + SCALE_SUFFIX], buffers[path] = pack_q4(*parts)
    missing = sorted(n for n in weight_map if n not in filled)
    if missing:
        raise ValueError(
            f"Checkpoint {model_config.model} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}."
        )
    return buffers


def _stack_groups(buffers: dict, path: str, index: tuple, groups, target, copies: int, head_dim: int) -> None:
    """One layer's GroupQuantized kernel [in, out] into the stacked host buffers of its values,
    scales and mins (KV heads repeated along the output axis as for float kernels)."""
    if copies > 1:
        groups = groups.map(lambda a: repeat_kv_heads(a, a.ndim - 1, copies, head_dim))
    want = target.shape[len(index) :]
    packed = groups.min is not None  # 4-bit: the model holds two values a byte
    if groups.shape != ((2 * want[0], want[1]) if packed else tuple(want)):
        raise ValueError(f"{path}: a quantized tensor of shape {groups.shape} does not fit {tuple(want)}.")
    parts = {path: groups.values, path + SCALE_SUFFIX: groups.scale}
    if packed:
        parts[path + MIN_SUFFIX] = groups.min
    for name, part in parts.items():
        if name not in buffers:
            buffers[name] = np.empty(target.shape[: len(index)] + part.shape, part.dtype)
        buffers[name][index] = part


def _restore_orbax(model_config, entry, args, abstract, mesh, expert_parallel):
    """Converted checkpoints hold the checkpoint's own KV heads; with kv_head_copies the
    KV projections are restored replicated, then expanded into their shards."""
    from jaxserve.loader import orbax

    copies = getattr(args, "kv_head_copies", 1)
    if copies == 1:
        return orbax.restore(model_config.model, abstract, state_shardings(abstract, mesh, expert_parallel))
    saved_args = dataclasses.replace(args, num_kv_heads=args.num_kv_heads // copies, kv_head_copies=1)
    dtype = jnp.dtype(model_config.dtype)
    _, saved = nnx.split(nnx.eval_shape(lambda: entry.model_cls(saved_args, dtype=dtype, rngs=nnx.Rngs(0))))
    shardings = state_shardings(saved, mesh, expert_parallel)
    replicated = jax.tree.map(
        lambda var, s: NamedSharding(mesh, PartitionSpec()) if _kv_axis(var) is not None else s,
        saved,
        shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    state = orbax.restore(model_config.model, saved, replicated)
    flat, target = dict(nnx.to_flat_state(state)), dict(nnx.to_flat_state(abstract))
    for key, var in flat.items():
        kv_axis = _kv_axis(var)
        if kv_axis is not None:
            sharding = named_sharding(mesh, var.get_metadata()["logical_axes"], expert_parallel)
            expand = jax.jit(
                lambda x, a=kv_axis: repeat_kv_heads(x, a, copies, args.head_dim), out_shardings=sharding
            )
            target[key].value = expand(var.value)
        else:
            target[key].value = var.value
    return nnx.from_flat_state(target)


def _score_from_lm_head(tensors, model_config: ModelConfig, args):
    """A generative checkpoint served as a classifier of some of its tokens (config's
    classifier_from_token, as vLLM takes it: Qwen3-Reranker's ["no", "yes"]): the score head is
    those tokens' rows of the LM head (of the token embeddings when tied); for two tokens, one
    label, the second's row less the first's (its sigmoid is the softmax of the two tokens' logits).
    A reward model's returned_token_ids (token ids already): their rows as they are."""
    from jaxserve.loader.tokenizer import load_tokenizer

    tokens = list(model_config.pooler_config.classifier_tokens)
    ids = list(model_config.pooler_config.score_token_ids)
    if tokens:
        tokenizer = load_tokenizer(model_config)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens] if tokenizer is not None else [None]
        if None in ids or tokenizer.unk_token_id in ids:
            raise ValueError(f"classifier_from_token {tokens} are not all tokens of the model's vocabulary.")
    tied = bool(model_config.hf_config.get("tie_word_embeddings", False))
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    for name, tensor in tensors:
        if name == head:
            rows = np.asarray(tensor)[ids]
            yield "score.weight", rows[1:] - rows[:1] if len(tokens) == 2 else rows
            if not tied:
                continue
        yield name, tensor
