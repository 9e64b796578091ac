"""EngineArgs -> EngineConfig: the checks that need neither a model nor a device (`validate`),
then the devices, the model and the configuration built from them (`build_engine_config`).

Every refusal is a ValueError of one line that names the flag and what is supported.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from jaxserve.args_fields import EngineArgsFields
from jaxserve.config import (
    SPECULATIVE_METHODS,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from jaxserve.engine.tracing import exporter_class
from jaxserve.flags import as_dict, check_flag_values, parse_human_int
from jaxserve.model_resolution import devices, model_config_from_args, platform
from jaxserve.pooler_resolution import is_encoder
from jaxserve.reasoning import get_reasoning_parser
from jaxserve.structured_output.grammar import check_backend

logger = logging.getLogger(__name__)


def validate(args: EngineArgsFields) -> None:
    """Refuse what needs neither a model nor a device, so a bad command line fails before
    anything starts (it touches no JAX device: a multi-process run must join its peers first).

    Called again by `create_engine_config`; the tier-C warnings are logged once per EngineArgs.
    """
    if args.extra:
        raise ValueError(f"unknown engine argument(s): {', '.join(sorted(args.extra))}.")
    if args.worker_use_ray:
        raise ValueError(
            "--worker-use-ray (= --distributed-executor-backend ray) is not supported by jaxserve yet; "
            "supported: one host (backend mp or uni)."
        )
    warnings = check_flag_values(args)
    positive = (
        "max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size", "max_logprobs",
        "max_num_batched_tokens", "num_gpu_blocks_override",
    )  # fmt: skip
    for name in positive:
        value = getattr(args, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}.")
    memory = parse_human_int(args.kv_cache_memory_bytes, "kv_cache_memory_bytes")
    if memory is not None and memory <= 0:
        raise ValueError(f"kv_cache_memory_bytes must be positive, got {args.kv_cache_memory_bytes}.")
    if args.num_gpu_blocks_override is not None and args.num_gpu_blocks_override < 2:
        raise ValueError("num_gpu_blocks_override must be at least 2 (one page is reserved for padding).")
    for name in ("swap_space", "cpu_offload_gb"):
        value = getattr(args, name)
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be >= 0 (GiB), got {value!r}.")
    if args.long_prefill_token_threshold < 0:
        raise ValueError("long_prefill_token_threshold must be >= 0.")
    if not isinstance(args.scheduler_delay_factor, (int, float)) or args.scheduler_delay_factor < 0:
        raise ValueError(f"scheduler_delay_factor must be >= 0, got {args.scheduler_delay_factor!r}.")
    if args.otlp_traces_endpoint:
        exporter_class()  # the packages and the protocol are there
    _check_kv_scales(args)
    _check_rope(args)
    spec = speculative_config(args.speculative_config)
    if spec is not None and spec.method == "draft_model" and (args.num_processes or 1) > 1:
        raise ValueError(
            "--speculative-config method 'draft_model' runs on one process; with several "
            "(--num-processes) use method ngram or suffix."
        )
    _check_distributed(args)
    if _structured_outputs_config(args).disable_fallback and not args.guided_decoding_disable_fallback:
        warnings.append(
            "--structured-outputs-config disable_fallback has no effect in jaxserve (one backend, no fallback)."
        )
    if args.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}.")
    if not getattr(args, "_warned", False):
        for line in warnings:
            logger.warning(line)
        args._warned = True


def _structured_outputs_config(args: EngineArgsFields) -> StructuredOutputsConfig:
    """--structured-outputs-config over the older --guided-decoding-* flags and --reasoning-parser."""
    given = as_dict(args.structured_outputs_config, "structured_outputs_config")
    known = {f.name for f in dataclasses.fields(StructuredOutputsConfig)}
    if set(given) - known:
        raise ValueError(
            f"structured_outputs_config keys {sorted(set(given) - known)} are not known; known: {sorted(known)}."
        )
    if args.enable_reasoning and not args.reasoning_parser:
        raise ValueError("--enable-reasoning needs --reasoning-parser (which alone is enough).")
    config = StructuredOutputsConfig(
        backend=args.guided_decoding_backend,
        disable_fallback=args.guided_decoding_disable_fallback,
        disable_any_whitespace=args.guided_decoding_disable_any_whitespace,
        disable_additional_properties=args.guided_decoding_disable_additional_properties,
        reasoning_parser=args.reasoning_parser or "",
    )
    config = dataclasses.replace(config, **given)
    check_backend(
        config.backend,
        "--structured-outputs-config backend" if "backend" in given else "--guided-decoding-backend",
    )
    if config.reasoning_parser:
        get_reasoning_parser(config.reasoning_parser)
    return config


def _check_distributed(args: EngineArgsFields) -> None:
    """The multi-process flags hang together."""
    if args.distributed_executor_backend != "jax":
        for name in ("data_parallel_address", "data_parallel_rpc_port", "num_processes", "process_id"):
            if getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} needs --distributed-executor-backend jax.")
        return
    if args.data_parallel_size > 1:
        raise ValueError("--distributed-executor-backend jax serves one replica (-dp 1) for now.")
    given = [args.data_parallel_address, args.num_processes, args.process_id]
    if any(v is not None for v in given) and any(v is None for v in given):
        raise ValueError(
            "--distributed-executor-backend jax needs --data-parallel-address, --num-processes and "
            "--process-id together (or none of them on a TPU VM, where JAX finds them)."
        )
    if args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}.")


def _check_kv_scales(args: EngineArgsFields) -> None:
    """Where a quantized KV cache's scales come from: one source at most, a file that is there.
    (With --kv-cache-dtype auto there are no scales, and, as in vLLM, neither flag matters.)"""
    path, calculate = args.quantization_param_path, args.calculate_kv_scales
    if path and calculate:
        raise ValueError("Give --quantization-param-path or --calculate-kv-scales, not both.")
    if path and not os.path.isfile(os.path.expanduser(path)):
        raise ValueError(f"--quantization-param-path {path!r} is not a file.")


def _check_rope(args: EngineArgsFields) -> None:
    scaling = as_dict(args.rope_scaling, "rope_scaling")
    if args.rope_theta is not None and not args.rope_theta > 0:
        raise ValueError(f"--rope-theta must be positive, got {args.rope_theta}.")
    if not scaling:
        return
    from jaxserve.layers.rotary import ROPE_REQUIRED_KEYS

    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in ROPE_REQUIRED_KEYS:
        raise ValueError(
            f"--rope-scaling rope_type {rope_type!r} is not supported by jaxserve; "
            f"supported: {', '.join(ROPE_REQUIRED_KEYS)}."
        )
    missing = [key for key in ROPE_REQUIRED_KEYS[rope_type] if key not in scaling]
    if missing:
        raise ValueError(f"--rope-scaling of rope_type {rope_type!r} needs {', '.join(missing)}.")


def build_engine_config(args: EngineArgsFields) -> EngineConfig:
    """Validate, join the other processes if asked (before any device is touched: JAX requires
    it), check the devices, then resolve the model once."""
    validate(args)
    from jaxserve import distributed

    distributed.initialize_from_args(args)
    backend = _attention_backend(args)
    model_config = model_config_from_args(args)
    _check_quantization_source(args.quantization, model_config)
    _check_pipeline(args, model_config)
    scheduler_config = _scheduler_config(args, model_config.max_model_len)  # (checked before the cache)
    cache_config = _cache_config(args, backend, model_config.dtype)
    if model_config.runner_type == "pooling":
        if args.speculative_config:
            raise ValueError("--speculative-config needs a generative model; this one is served for pooling.")
        # a prompt's mean or first token needs every token's hidden state: none comes from the cache
        cache_config = dataclasses.replace(cache_config, enable_prefix_caching=False)
        if is_encoder(model_config.hf_config):  # each token attends to the whole prompt: one step
            batched, max_len = scheduler_config.max_num_batched_tokens, model_config.max_model_len
            if batched < max_len and args.max_num_batched_tokens is None:  # (vLLM raises the default too)
                scheduler_config = dataclasses.replace(scheduler_config, max_num_batched_tokens=max_len)
            elif batched < max_len:
                raise ValueError(
                    f"An encoder runs a prompt whole in one step: max_num_batched_tokens "
                    f"({scheduler_config.max_num_batched_tokens}) must be >= max_model_len ({model_config.max_model_len})."
                )
            scheduler_config = dataclasses.replace(scheduler_config, enable_chunked_prefill=False)
    return EngineConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        parallel_config=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=args.data_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
        ),
        compilation_config=_compilation_config(args, backend),
        structured_outputs_config=_structured_outputs_config(args),
        lora_config=_lora_config(args),
        otlp_traces_endpoint=args.otlp_traces_endpoint or None,
        speculative_config=_checked_draft(
            speculative_config(args.speculative_config, scheduler_config), model_config, args
        ),
    )


def _checked_draft(
    spec: SpeculativeConfig | None, target: ModelConfig, args: EngineArgsFields
) -> SpeculativeConfig | None:
    """A draft model must be one jaxserve serves, of the target's vocabulary: checked from its
    configuration at start-up (ValueError, one line), before any weight loads."""
    if spec is None or spec.method != "draft_model":
        return spec
    # the target's arguments less what names its model: the draft's own model, in the target's
    # dtype and length
    draft_args = dataclasses.replace(
        args, model=spec.model, quantization=spec.quantization, dtype=target.dtype,
        max_model_len=target.max_model_len, tokenizer=None, revision=None, code_revision=None,
        hf_overrides=None, rope_scaling=None, rope_theta=None,
        load_format="dummy" if args.load_format == "dummy" else "auto",  # (as the TPU compile check's)
    )  # fmt: skip
    try:
        draft = model_config_from_args(draft_args)
        _check_quantization_source(spec.quantization, draft)
    except ValueError as e:
        raise ValueError(f"--speculative-config model {spec.model!r}: {e}") from None
    if draft.get("vocab_size") != target.get("vocab_size"):
        raise ValueError(
            f"--speculative-config model {spec.model!r} has a vocabulary of {draft.get('vocab_size')} "
            f"tokens, the target {target.get('vocab_size')}: a draft must share the target's tokenizer."
        )
    return dataclasses.replace(spec, draft_model_config=draft)


def speculative_config(value, scheduler: SchedulerConfig | None = None) -> SpeculativeConfig | None:
    """--speculative-config as vLLM reads it (a JSON object; `model: "ngram"` names the method
    too), checked: the method is one jaxserve runs, every key is one it honours, the numbers are
    in range."""
    given = dict(as_dict(value, "speculative_config"))
    if not given:
        return None
    method = given.pop("method", None)
    model = given.pop("model", None)
    if method is None and model is not None:
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    if method is None:
        raise ValueError(
            "--speculative-config needs a method (supported: " + ", ".join(SPECULATIVE_METHODS) + ")."
        )
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"--speculative-config method {method!r} is not supported by jaxserve; supported: "
            + ", ".join(SPECULATIVE_METHODS)
            + "."
        )
    if method == "draft_model":
        if not model:
            raise ValueError("--speculative-config method 'draft_model' needs a model (the draft's path).")
        given["model"] = model
    elif model not in (None, "ngram", "[ngram]"):
        raise ValueError(f"--speculative-config method {method!r} takes no model (got {model!r}).")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)} - {"method"}
    prefix = {"suffix": "suffix_decoding_", "ngram": "prompt_lookup_"}.get(method, "-")
    honoured = {
        k for k in known if k.startswith(prefix) or k in ("num_speculative_tokens", "disable_by_batch_size")
    }
    if method == "draft_model":
        honoured |= {"model", "quantization"}
    if set(given) - honoured:
        raise ValueError(
            f"--speculative-config keys {sorted(set(given) - honoured)} do not apply to method {method!r}; "
            f"it takes {sorted(honoured)}."
        )
    if method == "ngram":
        low, high = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
        given["prompt_lookup_min"] = low if low is not None else (high if high is not None else 5)
        given["prompt_lookup_max"] = high if high is not None else given["prompt_lookup_min"]
    if method in ("ngram", "draft_model"):
        if "num_speculative_tokens" not in given:
            raise ValueError(f"--speculative-config method {method!r} needs num_speculative_tokens.")
    else:
        given.setdefault("num_speculative_tokens", given.get("suffix_decoding_max_tree_depth", 24))
    config = SpeculativeConfig(method=method, **given)
    _check_speculative_numbers(config, scheduler)
    return config


def _check_speculative_numbers(config: SpeculativeConfig, scheduler: SchedulerConfig | None) -> None:
    def check(name: str, ok, what: str) -> None:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ValueError(f"--speculative-config {name} must be {what}, got {value!r}.")

    # a step holds the last token and the proposals
    most = scheduler.max_num_batched_tokens - 1 if scheduler is not None else 2**31
    check("num_speculative_tokens", lambda v: v == int(v) and 1 <= v <= most, f"an integer in [1, {most}]")
    check("prompt_lookup_min", lambda v: v == int(v) and v >= 1, "an integer >= 1")
    if config.disable_by_batch_size is not None:
        check("disable_by_batch_size", lambda v: v == int(v) and v >= 1, "an integer >= 1")
    check(
        "prompt_lookup_max",
        lambda v: v == int(v) and v >= config.prompt_lookup_min,
        "an integer >= prompt_lookup_min",
    )
    check("suffix_decoding_max_tree_depth", lambda v: v == int(v) and v >= 1, "an integer >= 1")
    check("suffix_decoding_max_cached_requests", lambda v: v == int(v) and v >= 0, "an integer >= 0")
    check("suffix_decoding_max_spec_factor", lambda v: v > 0, "> 0")
    check("suffix_decoding_min_token_prob", lambda v: 0 <= v <= 1, "in [0, 1]")


def _check_quantization_source(flag: str | None, model_config: ModelConfig) -> None:
    """A --quantization method that only reads a checkpoint's own quantized values (not one jaxserve
    applies at load, such as int8 or fp8) needs a checkpoint quantized that way; refused otherwise,
    naming what the checkpoint holds, rather than served unquantized."""
    from jaxserve.layers.linear import WEIGHT_QUANTIZATIONS
    from jaxserve.loader.prequantized import METHODS

    if flag not in METHODS or flag in WEIGHT_QUANTIZATIONS or model_config.checkpoint_quantization == flag:
        return
    if model_config.load_format == "gguf":
        actual = "GGUF quantization (served with --quantization gguf)"
    else:
        method = (model_config.get("quantization_config") or {}).get("quant_method")
        actual = f"quant_method {method!r}" if method else "no quantization_config (it is not quantized)"
    raise ValueError(
        f"--quantization {flag} needs a checkpoint quantized with {flag}; {model_config.model!r} has "
        f"{actual}. jaxserve quantizes at load only with --quantization {' or '.join(WEIGHT_QUANTIZATIONS)}."
    )


def _attention_backend(args: EngineArgsFields) -> str:
    """--attention-backend resolved for this platform, and enough devices for the mesh."""
    from jaxserve.layers.attention import resolve_attention_backend

    backend = resolve_attention_backend(args.attention_backend, platform())
    if backend == "tpu-interpret" and args.tensor_parallel_size > 1:
        raise ValueError(
            "--attention-backend pallas-tpu-interpret runs on one device: JAX's TPU interpreter stalls "
            "in a step split over several (use pallas-gpu-interpret or reference with -tp)."
        )
    visible = len(devices())
    if args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size > visible:
        raise ValueError(
            f"tensor_parallel_size={args.tensor_parallel_size} x pipeline_parallel_size="
            f"{args.pipeline_parallel_size} x data_parallel_size={args.data_parallel_size} needs that "
            f"many devices; {visible} visible."
        )
    return backend


def _check_pipeline(args: EngineArgsFields, model_config: ModelConfig) -> None:
    """Each stage holds as many layers as the others: the layer count divides into the stages."""
    stages = args.pipeline_parallel_size
    layers = model_config.get("num_hidden_layers", model_config.get("n_layer"))
    if stages > 1 and layers and layers % stages:
        raise ValueError(
            f"pipeline_parallel_size={stages} does not divide the model's {layers} layers into equal "
            f"stages; choose a divisor of {layers}."
        )


def _scheduler_config(args: EngineArgsFields, max_len: int) -> SchedulerConfig:
    batched = args.max_num_batched_tokens or (2048 if platform() == "cpu" else 8192)
    if not args.enable_chunked_prefill and batched < max_len:
        raise ValueError(
            f"max_num_batched_tokens ({batched}) is smaller than max_model_len ({max_len}) with chunked "
            "prefill disabled: a long prompt could never be scheduled. Raise it or enable chunked prefill."
        )
    if batched < args.max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({batched}) must be >= max_num_seqs ({args.max_num_seqs}).")
    return SchedulerConfig(
        max_num_batched_tokens=batched,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        policy=args.scheduling_policy,
        preemption_mode=args.preemption_mode,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        delay_factor=args.scheduler_delay_factor,
        async_scheduling=args.async_scheduling is not False,
    )


def _cache_config(args: EngineArgsFields, backend: str, model_dtype) -> CacheConfig:
    from jaxserve.layers.attention import check_page_size, default_block_size

    cache = CacheConfig(
        block_size=args.block_size or default_block_size(backend, args.kv_cache_dtype),
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=parse_human_int(args.kv_cache_memory_bytes, "kv_cache_memory_bytes"),
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        cache_dtype=args.kv_cache_dtype,
        quantization_param_path=args.quantization_param_path,
        calculate_kv_scales=args.calculate_kv_scales,
        swap_space=args.swap_space,
        cpu_offload_gb=args.cpu_offload_gb,
    )
    check_page_size(backend, cache.block_size, cache.kv_pool_dtype(model_dtype))
    return cache


def _compilation_config(args: EngineArgsFields, backend: str) -> CompilationConfig:
    comp = as_dict(args.compilation_config, "compilation_config")
    unknown = set(comp) - {"token_buckets", "seq_buckets", "cache_dir", "pipeline_microbatch_tokens"}
    if unknown:
        raise ValueError(f"compilation_config keys {sorted(unknown)} are not supported.")
    return CompilationConfig(
        enforce_eager=args.enforce_eager,
        token_buckets=tuple(comp["token_buckets"]) if "token_buckets" in comp else None,
        seq_buckets=tuple(comp["seq_buckets"]) if "seq_buckets" in comp else None,
        cache_dir=comp.get("cache_dir"),
        min_token_bucket=1 if platform() == "cpu" else 16,
        attention_backend=backend,
        pipeline_microbatch_tokens=comp.get("pipeline_microbatch_tokens"),
    )


def _lora_config(args: EngineArgsFields) -> LoRAConfig | None:
    if not args.enable_lora:
        return None
    if args.max_loras < 1 or not 1 <= args.max_lora_rank <= 512:
        raise ValueError(
            f"max_loras must be >= 1 and max_lora_rank in [1, 512], got {args.max_loras} and {args.max_lora_rank}."
        )
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise ValueError(f"max_cpu_loras ({args.max_cpu_loras}) must be >= max_loras ({args.max_loras}).")
    return LoRAConfig(
        args.max_loras,
        args.max_lora_rank,
        args.max_cpu_loras,
        args.enable_lora_bias,
        args.fully_sharded_loras,
    )
