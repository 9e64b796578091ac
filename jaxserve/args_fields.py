"""The engine's arguments: one field per vLLM flag, with vLLM's names, defaults and help.

Each field is also a `jaxserve serve/generate/chat` flag (cli.py derives the flags from the
fields' metadata, see `arg` in flags.py). The table is long because vLLM's flag set is; the checks
and the EngineConfig built from it are args_to_config.py, and EngineArgs (args.py) joins the two.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from jaxserve.config import (
    ATTENTION_BACKENDS,
)
from jaxserve.flags import G, arg
from jaxserve.model_resolution import DTYPES

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "orbax", "dummy")
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


@dataclass
class EngineArgsFields:
    """Every flag's field; EngineArgs (args.py) adds the checks and the EngineConfig."""

    # ---- ModelConfig
    model: str | None = arg(
        G.MODEL,
        None,
        "HF repo id (local HF cache only), model directory or .gguf file; unset = the default model "
        "(SmolLM2-135M-Instruct).",
    )
    served_model_name: str | list[str] | None = arg(G.MODEL, None, "Name(s) the model answers to in the API.")
    tokenizer: str | None = arg(G.MODEL, None, "Tokenizer directory or .gguf file; unset = the model's.")
    tokenizer_mode: str = arg(
        G.MODEL,
        "auto",
        "Tokenizer implementation; jaxserve loads Hugging Face fast tokenizers (or a .gguf file's own), "
        "never the slow Python ones.",
        choices=("auto", "slow", "mistral", "custom"),
        supported=("auto",),
    )
    revision: str | None = arg(G.MODEL, None, "Model revision in the local HF cache.")
    tokenizer_revision: str | None = arg(G.MODEL, None, "Tokenizer revision in the local HF cache.")
    trust_remote_code: bool = arg(G.MODEL, False, "Trust custom code of a HF checkpoint.")
    hf_overrides: dict | str | None = arg(
        G.MODEL, help="JSON object merged into the HF config.", factory=dict
    )
    dtype: str = arg(
        G.MODEL,
        "auto",
        "Weight and activation dtype; auto = the checkpoint's (float32 on CPU).",
        choices=tuple(DTYPES),
    )
    max_model_len: int | str | None = arg(
        G.MODEL,
        None,
        "Context length (prompt + output); accepts 2048, 1k, 1K, 25.6k. Unset = the model's "
        "max_position_embeddings.",
    )
    seed: int = arg(G.MODEL, 0, "Engine random seed.")
    load_format: str = arg(
        G.LOAD,
        "auto",
        "Weight format; auto picks from the file; dummy = random weights of the real shapes.",
        choices=(
            "auto",
            "pt",
            "safetensors",
            "npcache",
            "dummy",
            "tensorizer",
            "sharded_state",
            "gguf",
            "bitsandbytes",
            "mistral",
            "runai_streamer",
            "fastsafetensors",
            "orbax",
        ),  # fmt: skip
        supported=LOAD_FORMATS,
    )
    use_tqdm_on_load: bool = arg(G.LOAD, True, "Show a progress bar while loading weights.")
    generation_config: str = arg(
        G.MODEL, "auto", "Where default sampling settings come from: auto (the model's), vllm, or a dir."
    )
    override_generation_config: dict | str | None = arg(
        G.MODEL, help="JSON object overriding the generation config.", factory=dict
    )
    max_logprobs: int = arg(G.MODEL, 20, "Largest logprobs a request may ask for.")
    skip_tokenizer_init: bool = arg(G.MODEL, False, "Do not load a tokenizer (token-id prompts only).")
    enforce_eager: bool = arg(
        G.MODEL, False, "Compile shapes lazily on first use instead of precompiling every bucket."
    )
    max_seq_len_to_capture: int = arg(
        G.MODEL,
        8192,
        "Longest context vLLM's CUDA graphs cover. jaxserve's precompiled step programs take every "
        "context up to --max-model-len (the page table spans it), so there is nothing to bound.",
        tier="C",
    )
    attention_backend: str = arg(
        G.MODEL,
        "auto",
        "Ragged paged attention implementation (a jaxserve flag): auto = the Pallas kernel of the "
        "platform (TPU, GPU), the pure-jnp reference on CPU; reference; pallas (refused where there "
        "is no kernel); pallas-tpu-interpret / pallas-gpu-interpret run a kernel in Pallas' interpret "
        "mode anywhere (slow; for checking kernels on CPU).",
        choices=ATTENTION_BACKENDS,
    )
    compilation_config: dict | str | None = arg(
        G.COMP,
        help="JSON object: token_buckets, seq_buckets, cache_dir, pipeline_microbatch_tokens (rows "
        "a pipeline microbatch is worth: default the TPU's ridge point, else 256; 0: never cut a step) "
        '(e.g. \'{"cache_dir": ""}\').',
        short="-O",
        factory=dict,
    )
    # ---- CacheConfig
    block_size: int | None = arg(
        G.CACHE, None, "Tokens per KV-cache page; unset = the platform default (16).", choices=BLOCK_SIZES
    )
    gpu_memory_utilization: float = arg(G.CACHE, 0.9, "Share of accelerator memory for weights and KV pages.")
    num_gpu_blocks_override: int | None = arg(
        G.CACHE, None, "Exact number of KV-cache pages (overrides the memory budget)."
    )
    kv_cache_memory_bytes: int | str | None = arg(
        G.CACHE,
        None,
        "KV-cache bytes per device, instead of what --gpu-memory-utilization leaves; accepts 1G, "
        "512M, 1.5g. Unset on CPU = 1 GiB.",
    )
    swap_space: float = arg(
        G.CACHE,
        4,
        "GiB of host memory for preempted requests' KV pages (--preemption-mode swap); taken as "
        "requests are swapped out, never reserved.",
    )
    kv_cache_dtype: str = arg(
        G.CACHE,
        "auto",
        "KV-cache dtype: auto (the model's), fp8 (= fp8_e4m3), fp8_e5m2 or int8, each with one key "
        "and one value scale per layer (--quantization-param-path, --calculate-kv-scales, else 1.0; "
        "int8 measures them at start-up unless a file gives them).",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"),
    )
    enable_prefix_caching: bool = arg(G.CACHE, True, "Reuse KV pages of shared prompt prefixes.")
    prefix_caching_hash_algo: str = arg(
        G.CACHE,
        "sha256",
        "Hash of prefix-cache keys (builtin: 64-bit Python hash, collidable by crafted "
        "prompts; every hit is also checked against its tokens).",
        choices=("builtin", "sha256"),
    )
    # ---- SchedulerConfig
    max_num_batched_tokens: int | None = arg(
        G.SCHED, None, "Token budget of one engine step; unset = per platform (2048 CPU, 8192 else)."
    )
    max_num_seqs: int = arg(G.SCHED, 256, "Most sequences in one engine step.")
    enable_chunked_prefill: bool = arg(G.SCHED, True, "Split long prompts across steps.")
    long_prefill_token_threshold: int = arg(
        G.SCHED, 0, "Prompts longer than this count as long prefills (0 = off)."
    )
    scheduling_policy: str = arg(
        G.SCHED, "fcfs", "fcfs, or priority (lower value first, then arrival).", choices=("fcfs", "priority")
    )
    async_scheduling: bool | None = arg(
        G.SCHED,
        None,
        "Plan and dispatch the next step while the device runs this one; unset = on.",
    )
    preemption_mode: str = arg(
        G.SCHED,
        "recompute",
        "How a preempted sequence gets its KV pages back.",
        choices=("recompute", "swap"),
    )
    # ---- ParallelConfig
    tensor_parallel_size: int = arg(G.PARALLEL, 1, "Devices on the 'model' mesh axis.", short="-tp")
    data_parallel_size: int = arg(
        G.PARALLEL,
        1,
        "Engine replicas behind one server, each on its own tensor_parallel_size devices.",
        short="-dp",
    )
    pipeline_parallel_size: int = arg(
        G.PARALLEL,
        1,
        "Pipeline stages: the layers split into this many groups of consecutive layers, each on its "
        "own tensor_parallel_size devices.",
        short="-pp",
    )

    # ---- ModelConfig, continued
    task: str = arg(
        G.MODEL,
        "auto",
        "What the model is served for (vLLM's older spelling of --runner / --convert): embed (or "
        "embedding) serves it as an embedding model, classify (or score) a sequence classifier, reward "
        "a reward model.",
        choices=("auto", "generate", "embedding", "embed", "classify", "score", "reward", "transcription"),
        supported=("auto", "generate", "embedding", "embed", "classify", "score", "reward"),
    )
    runner: str = arg(
        G.MODEL,
        "auto",
        "generate: a language model (tokens out); pooling: an embedding model (a vector per prompt). "
        "auto: pooling for a base model's architecture (e.g. Qwen3Model) or a sentence-transformers "
        "folder, else generate.",
        choices=("auto", "generate", "pooling", "draft"),
        supported=("auto", "generate", "pooling"),
    )
    convert: str = arg(
        G.MODEL,
        "auto",
        "What a pooling runner makes of the model: embed (its final hidden states, pooled), "
        "classify (a *ForSequenceClassification checkpoint's score head over them) or reward (a row "
        "per token: a reward head's, returned_token_ids' logits or the hidden states). auto: the "
        "checkpoint's own.",
        choices=("auto", "none", "embed", "classify", "reward", "mm_encoder_only"),
        supported=("auto", "none", "embed", "classify", "reward"),
    )
    pooler_config: dict | str | None = arg(
        G.MODEL,
        None,
        "JSON object: how a pooling model reduces a prompt (pooling_type LAST, MEAN, CLS, ALL or STEP; "
        "normalize, dimensions; a classifier's activation; a reward model's step_tag_id and "
        "returned_token_ids), over the model's sentence-transformers files.",
    )
    override_pooler_config: dict | str | None = arg(
        G.MODEL, None, "vLLM's older name of --pooler-config (the two are merged, this one last)."
    )
    code_revision: str | None = arg(
        G.MODEL,
        None,
        "Revision of the model's custom code; jaxserve never runs a checkpoint's code.",
        tier="C",
    )
    hf_config_path: str | None = arg(
        G.MODEL, None, "Directory (or cached HF repo id) whose config.json replaces the model's."
    )
    hf_token: bool | str | None = arg(
        G.MODEL,
        None,
        "HF hub token; jaxserve downloads nothing (local files and the HF cache only).",
        tier="C",
        secret=True,
        nargs="?",
        const=True,
    )
    config_format: str = arg(
        G.MODEL,
        "auto",
        "Format of the model config.",
        choices=("auto", "hf", "mistral"),
        supported=("auto", "hf"),
    )
    rope_scaling: dict | str | None = arg(
        G.MODEL,
        None,
        'JSON object replacing the config\'s rope_scaling, e.g. \'{"rope_type": "linear", "factor": 2}\'; '
        "rope types: default, linear, dynamic, llama3.",
    )
    rope_theta: float | None = arg(G.MODEL, None, "RoPE base frequency, replacing the config's rope_theta.")
    model_impl: str = arg(
        G.MODEL,
        "auto",
        "Model implementation; vllm and auto both mean jaxserve's own.",
        choices=("auto", "vllm", "transformers"),
        supported=("auto", "vllm"),
    )
    quantization: str | None = arg(
        G.MODEL,
        None,
        "Weight quantization method: int8 or fp8 (weight-only, one scale per output channel, "
        "quantized at load); gguf (a .gguf file's own Q8_0 / Q4_0 / Q4_1 / Q4_K groups, the "
        "default for .gguf files); none (dequantize a .gguf file at load). A checkpoint another tool "
        "quantized (quant_method fp8 or compressed-tensors) is served from its own values; the flag "
        "may name its method.",
        tier="B",
        short="-q",
        supported=(None, "gguf", "int8", "fp8", "none", "compressed-tensors"),
    )
    disable_sliding_window: bool = arg(
        G.MODEL, False, "Cap max_model_len at the model's sliding window (jaxserve applies no window)."
    )
    disable_cascade_attn: bool = arg(
        G.MODEL,
        False,
        "Disable cascade attention (vLLM's shared-prefix CUDA kernel); jaxserve has none, it is always off.",
        tier="C",
    )
    enable_prompt_embeds: bool = arg(
        G.MODEL,
        False,
        "Accept prompt embeddings as input (offline prompt_embeds arrays; the completions API's base64 tensors).",
    )
    logits_processor_pattern: str | None = arg(
        G.MODEL, None, "Regex of logits-processor import paths requests may name.", tier="B"
    )
    enable_sleep_mode: bool = arg(
        G.MODEL,
        False,
        "Allow LLM.sleep() / wake_up() (and the server's /sleep, /wake_up with VLLM_SERVER_DEV_MODE=1) "
        "to free the weights and KV cache on the devices and take them back.",
    )
    allowed_local_media_path: str = arg(
        G.MODEL, "", "Directory whose files a chat request's file:// image URLs may read (unset: none)."
    )
    override_neuron_config: dict | None = arg(G.MODEL, None, "Neuron device settings.", tier="C")
    max_context_len_to_capture: int | None = arg(
        G.MODEL, None, "Older name of --max-seq-len-to-capture.", tier="C"
    )
    # ---- LoadConfig, continued
    download_dir: str | None = arg(G.LOAD, None, "HF cache directory to resolve hub ids from.")
    # jaxserve downloads nothing and reads only a checkpoint's weight files, so patterns are
    # honoured unless they exclude one of those (refused when the model is resolved).
    ignore_patterns: list[str] | str | None = arg(G.LOAD, None, "File patterns to skip when loading.")
    model_loader_extra_config: dict = arg(G.LOAD, help="Extra loader settings.", tier="C", factory=dict)
    pt_load_map_location: str | dict = arg(
        G.LOAD, "cpu", "Where .pt checkpoints are mapped.", tier="C", type=str
    )
    # ---- DecodingConfig
    guided_decoding_backend: str = arg(
        G.DECODING,
        "auto",
        "Structured-outputs engine (JSON schema, regex, choice, grammar): guidance (llguidance); the "
        "others need torch.",
        choices=("auto", "guidance", "lm-format-enforcer", "outlines", "xgrammar"),
    )
    guided_decoding_disable_fallback: bool = arg(
        G.DECODING, False, "No fallback backend; jaxserve has one backend and never falls back.", tier="C"
    )
    guided_decoding_disable_any_whitespace: bool = arg(
        G.DECODING, False, "No free whitespace in guided JSON."
    )
    guided_decoding_disable_additional_properties: bool = arg(
        G.DECODING, False, "No additionalProperties in guided JSON."
    )
    structured_outputs_config: dict | str | None = arg(
        G.DECODING,
        help="JSON object: backend, disable_fallback, disable_any_whitespace, disable_additional_properties, "
        "reasoning_parser (wins over the --guided-decoding-* flags).",
        factory=dict,
    )
    reasoning_parser: str = arg(
        G.DECODING, "", "Parser that splits reasoning from the answer: deepseek_r1, qwen3."
    )
    enable_reasoning: bool | None = arg(G.DECODING, None, "Deprecated: --reasoning-parser alone turns it on.")
    # ---- ParallelConfig, continued
    data_parallel_size_local: int | None = arg(
        G.PARALLEL, None, "Data-parallel replicas on this host.", tier="B", short="-dpl"
    )
    data_parallel_address: str | None = arg(
        G.PARALLEL,
        None,
        "Host of process 0 (the coordinator) with --distributed-executor-backend jax.",
        short="-dpa",
    )
    data_parallel_rpc_port: int | None = arg(
        G.PARALLEL, None, "Coordinator port with --distributed-executor-backend jax (13345).", short="-dpp"
    )
    data_parallel_backend: str = arg(
        G.PARALLEL, "mp", "How data-parallel replicas run.", tier="B", short="-dpb", choices=("mp", "ray")
    )
    data_parallel_start_rank: int | None = arg(
        G.PARALLEL, None, "First data-parallel rank on this host.", tier="B", short="-dpr"
    )
    enable_expert_parallel: bool = arg(
        G.PARALLEL, False, "Split MoE layers by whole experts over the tensor-parallel devices."
    )
    # mp and uni both describe what jaxserve does on one host: one process drives every local device.
    distributed_executor_backend: str | None = arg(
        G.PARALLEL,
        None,
        "How workers are launched; jax: one process per host, joined by jax.distributed.",
        tier="B",
        choices=("ray", "mp", "uni", "external_launcher", "jax"),
        supported=(None, "mp", "uni", "jax"),
    )
    # jaxserve's own: what jax.distributed.initialize needs besides the coordinator.
    num_processes: int | None = arg(
        G.PARALLEL, None, "Processes (hosts) with --distributed-executor-backend jax."
    )
    process_id: int | None = arg(
        G.PARALLEL, None, "This process's rank (0 serves HTTP) with the jax backend."
    )
    distributed_timeout: float = arg(
        G.PARALLEL, 300.0, "Seconds to wait for every process to arrive (jax backend)."
    )
    max_parallel_loading_workers: int | None = arg(
        G.PARALLEL,
        None,
        "Most weight-loading workers at once (vLLM loads in batches to bound host memory); jaxserve's "
        "one process reads one tensor at a time.",
        tier="C",
    )
    worker_use_ray: bool = arg(
        G.PARALLEL,
        False,
        "Older spelling of --distributed-executor-backend ray (not supported by jaxserve yet).",
        tier="B",
    )
    disable_custom_all_reduce: bool = arg(G.PARALLEL, False, "CUDA custom all-reduce.", tier="C")
    ray_workers_use_nsight: bool = arg(G.PARALLEL, False, "Profile Ray workers with Nsight.", tier="C")
    worker_cls: str = arg(G.PARALLEL, "auto", "Worker class.", tier="C")
    worker_extension_cls: str = arg(G.PARALLEL, "", "Worker extension class.", tier="C")
    # ---- CacheConfig, continued
    cpu_offload_gb: float = arg(
        G.CACHE,
        0,
        "GiB of each device's layer weights kept in host memory (pinned host memory), each layer's "
        "copied in as the step reaches it; frees as much device memory for the KV cache.",
    )
    calculate_kv_scales: bool = arg(
        G.CACHE,
        False,
        "Measure the quantized KV cache's per-layer scales at start-up, over a fixed calibration text.",
    )
    quantization_param_path: str | None = arg(
        G.CACHE,
        None,
        "JSON file of the quantized KV cache's per-layer scales (vLLM's kv_cache_scales format).",
    )
    # ---- MultiModalConfig
    limit_mm_per_prompt: dict = arg(
        G.MM,
        help='Most items of a modality one prompt may hold, as JSON: {"image": 2} (default: 999 images).',
        factory=dict,
    )
    mm_processor_kwargs: dict | None = arg(
        G.MM,
        None,
        'Overrides of the image processor\'s config, as JSON (e.g. {"do_image_splitting": false} or '
        '{"size": {"longest_edge": 1024}} for Idefics3 / SmolVLM, {"max_pixels": 200704} for Qwen2-VL).',
    )
    disable_mm_preprocessor_cache: bool = arg(
        G.MM, False, "Keep no encoded images between steps (each image is encoded for every prompt it is in)."
    )
    # ---- LoRAConfig
    enable_lora: bool = arg(
        G.LORA, False, "Serve LoRA adapters (PEFT directories) on the decoder layers' projections."
    )
    enable_lora_bias: bool = arg(G.LORA, False, "Serve LoRA adapters with biases (PEFT's lora_bias).")
    max_loras: int = arg(G.LORA, 1, "LoRA adapters one batch may mix (the device's adapter slots).")
    max_lora_rank: int = arg(G.LORA, 16, "Largest LoRA rank (every slot holds this rank).")
    lora_dtype: str = arg(
        G.LORA,
        "auto",
        "Dtype of the LoRA weights; jaxserve holds and applies them in float32 (auto = float32).",
        tier="B",
        choices=("auto", "float16", "bfloat16", "float32"),
        supported=("auto", "float32"),
    )
    max_cpu_loras: int | None = arg(
        G.LORA, None, "LoRA adapters kept read in host memory (default: max_loras)."
    )
    fully_sharded_loras: bool = arg(
        G.LORA, False, "Under tensor parallelism, split both LoRA factors (their rank too) over the devices."
    )
    lora_extra_vocab_size: int = arg(
        G.LORA,
        256,
        "Extra vocabulary of LoRA adapters. jaxserve serves none (an adapter that adds tokens is refused "
        "when read): only 0 or the default, which reserves nothing.",
        tier="B",
        supported=(256, 0),
    )
    long_lora_scaling_factors: list[float] | None = arg(
        G.LORA, None, "Scaling factors of long-context LoRA (not served).", tier="B"
    )
    # ---- PromptAdapterConfig
    enable_prompt_adapter: bool = arg(G.PA, False, "Prompt adapters.", tier="C")
    max_prompt_adapters: int = arg(G.PA, 1, "Prompt adapters in one batch.", tier="C")
    max_prompt_adapter_token: int = arg(G.PA, 0, "Prompt adapter tokens.", tier="C")
    # ---- DeviceConfig
    device: str = arg(
        G.DEVICE,
        "auto",
        "Device type (jaxserve uses JAX's default backend).",
        tier="C",
        choices=("auto", "cuda", "neuron", "cpu", "tpu", "xpu", "hpu"),
    )
    # ---- SpeculativeConfig
    speculative_config: dict | str | None = arg(
        G.SPEC,
        None,
        "JSON object: speculative decoding, as vLLM's: method ngram (num_speculative_tokens, "
        "prompt_lookup_min, prompt_lookup_max), suffix (suffix_decoding_max_tree_depth, "
        "suffix_decoding_max_cached_requests, suffix_decoding_max_spec_factor, suffix_decoding_min_token_prob) "
        "or draft_model (model: a smaller model of the same vocabulary, any format jaxserve serves; "
        "num_speculative_tokens; quantization); any method: disable_by_batch_size.",
    )
    # ---- ObservabilityConfig
    otlp_traces_endpoint: str | None = arg(
        G.OBS,
        None,
        "OTLP endpoint to send a span per request to (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL grpc or "
        "http/protobuf; needs pip install 'jaxserve[otel]').",
    )
    collect_detailed_traces: list[str] | None = arg(G.OBS, None, "Modules to trace in detail.", tier="B")
    show_hidden_metrics_for_version: str | None = arg(
        G.OBS,
        None,
        "Show metrics hidden since this version; jaxserve hides none, every metric is shown.",
        tier="C",
    )
    # ---- SchedulerConfig, continued
    max_num_partial_prefills: int = arg(G.SCHED, 1, "Concurrent partial prefills.", tier="B")
    max_long_partial_prefills: int = arg(G.SCHED, 1, "Concurrent long partial prefills.", tier="B")
    scheduler_delay_factor: float = arg(
        G.SCHED,
        0.0,
        "New prompts wait until the oldest has waited this many times the last prompt step's length "
        "(while others run), so that more of them start together.",
    )
    num_lookahead_slots: int = arg(G.SCHED, 0, "Speculative lookahead slots.", tier="C")
    num_scheduler_steps: int = arg(G.SCHED, 1, "Multi-step scheduling.", tier="C")
    multi_step_stream_outputs: bool = arg(G.SCHED, True, "Stream every multi-step output.", tier="C")
    scheduler_cls: str = arg(G.SCHED, "vllm.core.scheduler.Scheduler", "Scheduler class.", tier="C")
    use_v2_block_manager: bool = arg(G.SCHED, True, "Older block-manager switch.", tier="C")
    # ---- VllmConfig
    kv_transfer_config: dict | None = arg(G.VLLM, None, "Disaggregated KV transfer.", tier="C")
    kv_events_config: dict | None = arg(G.VLLM, None, "KV-cache event publishing.", tier="C")
    additional_config: dict | None = arg(G.VLLM, None, "Platform plug-in settings.", tier="C")
    # ---- flags of older vLLM releases, accepted so that older command lines still start
    tokenizer_pool_size: int = arg(G.TOKPOOL, 0, "Tokenizer pool size.", tier="C")
    tokenizer_pool_type: str = arg(G.TOKPOOL, "ray", "Tokenizer pool type.", tier="C")
    tokenizer_pool_extra_config: dict | None = arg(G.TOKPOOL, None, "Tokenizer pool settings.", tier="C")
    image_input_type: str | None = arg(
        G.VISION, None, "Image input type.", tier="C", choices=("pixel_values", "image_features")
    )
    image_token_id: int | None = arg(G.VISION, None, "Image token id.", tier="C")
    image_input_shape: str | None = arg(G.VISION, None, "Image input shape.", tier="C")
    image_feature_size: int | None = arg(G.VISION, None, "Image feature size.", tier="C")
    image_processor: str | None = arg(G.VISION, None, "Image processor.", tier="C")
    image_processor_revision: str | None = arg(G.VISION, None, "Image processor revision.", tier="C")
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"extra"}
