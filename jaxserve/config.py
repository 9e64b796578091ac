"""Frozen engine configuration, built once by EngineArgs.create_engine_config().

Field names follow vLLM's so that a vLLM user reading a log or a config file finds the
same words. Nothing mutates a config after it is built; every component reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# --attention-backend values (kept here, free of JAX, so the command line loads without it)
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "pallas-tpu-interpret", "pallas-gpu-interpret")


# --kv-cache-dtype -> the pool's dtype name ("auto": the model's dtype). vLLM's "fp8" is e4m3.
KV_CACHE_DTYPES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "int8": "int8",
}


def jaxserve_cache_dir(*parts: str) -> str:
    """Where jaxserve keeps what it can rebuild: $XDG_CACHE_HOME/jaxserve (~/.cache/jaxserve)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxserve", *parts)


@dataclass(frozen=True)
class ModelConfig:
    model: str  # the path that was loaded (HF directory or .gguf file)
    tokenizer: str  # directory or .gguf file the tokenizer comes from
    load_format: str  # resolved: "safetensors", "gguf" or "dummy"
    dtype: str  # resolved jnp dtype name: "float32", "bfloat16" or "float16"
    max_model_len: int
    seed: int
    hf_config: MappingProxyType  # the model's config.json (or its GGUF equivalent), read-only
    served_model_name: tuple[str, ...] = ()
    tokenizer_revision: str | None = None
    trust_remote_code: bool = False
    generation_config: str = "auto"
    override_generation_config: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    max_logprobs: int = 20
    skip_tokenizer_init: bool = False
    use_tqdm_on_load: bool = True
    enable_sleep_mode: bool = False  # LLMEngine.sleep / wake_up may free and retake device memory
    enable_prompt_embeds: bool = False  # prompts may come as embeddings (jaxserve/prompt_embeds.py)
    # Weight-only quantization of the layers' projections: "int8", "fp8" or None (as stored)
    quantization: str | None = None
    # The method of a checkpoint quantized by another tool ("fp8", "compressed-tensors"), served
    # from its own values and scales (loader/prequantized.py); None for the others
    checkpoint_quantization: str | None = None
    # "generate" (an LM: tokens out) or "pooling" (an embedding model: one vector per prompt)
    runner_type: str = "generate"
    pooler_config: PoolerConfig | None = None  # how a pooling model reduces a prompt; pooling only
    # Vision-language models (jaxserve/multimodal): the most images a prompt may hold
    # (--limit-mm-per-prompt), the image processor's overrides (--mm-processor-kwargs), and the
    # bytes of encoded images kept for reuse (0: --disable-mm-preprocessor-cache)
    limit_mm_per_prompt: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    mm_processor_kwargs: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    mm_cache_bytes: int = 1 << 30
    allowed_local_media_path: str = ""  # file:// image URLs are read only below this directory

    @property
    def is_multimodal(self) -> bool:
        """The model takes images beside text (its config has a vision part)."""
        return "vision_config" in self.hf_config

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or ["LlamaForCausalLM"]
        return archs[0]

    def get(self, key: str, default: Any = None) -> Any:
        return self.hf_config.get(key, default)

    def room_after(self, prompt_len: int) -> int:
        """The tokens a prompt of `prompt_len` leaves to generate under max_model_len; ValueError
        (vLLM's words, which the server returns as they are) when it leaves none. The one place
        a prompt's length is checked: the engine's requests, the server's and beam searches."""
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"request has {prompt_len} input tokens. Please reduce the length of the input messages."
            )
        return self.max_model_len - prompt_len


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt's final hidden states into one vector (vLLM's
    --pooler-config): which reduction (jaxserve/pooling_params.py POOLING_TYPES), whether to scale
    it to length 1, the default `dimensions`, and the Matryoshka sizes it was trained for (None: not a Matryoshka model).
    Resolved from the model's sentence-transformers files, then the flag's keys, at start-up."""

    pooling_type: str = "LAST"
    normalize: bool = True
    # "embed": the pooled vector is the output; "classify": it is a score head's logits over
    # `labels`, turned into probabilities (softmax; sigmoid for one label) when `activation`;
    # "reward": every token's row (ALL) or the step tags' (STEP) through the model's head, a
    # softmax over each row's labels when `activation` (no head, no labels: the hidden states)
    task: str = "embed"
    labels: tuple[str, ...] = ()
    activation: bool = True
    # a generative checkpoint served as a classifier of these tokens' logits (config.json's
    # classifier_from_token: Qwen3-Reranker's ["no", "yes"]); its score head is built at load
    classifier_tokens: tuple[str, ...] = ()
    # a reward model's head: a hidden layer (ReLU) then the labels' projection, both with biases
    # (Qwen2ForRewardModel's); or, for a generative checkpoint, these tokens' rows of its LM head
    # (vLLM's returned_token_ids: math-shepherd's "+" / "-" logits at each step)
    reward_hidden_layer: bool = False
    score_token_ids: tuple[int, ...] = ()
    step_tag_id: int | None = None  # STEP: the rows kept are at this prompt token (None: all)
    returned_token_ids: tuple[int, ...] = ()  # STEP: the columns kept of a head's rows (all if empty)
    dimensions: int | None = None  # a request's `dimensions` when it gives none
    matryoshka_dimensions: tuple[int, ...] | None = None
    is_matryoshka: bool = False


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    # Bytes of KV pool per device, instead of what gpu_memory_utilization leaves (vLLM's
    # kv_cache_memory_bytes); None on the CPU = CPU_KV_CACHE_BYTES.
    kv_cache_memory_bytes: int | None = None
    # The KV pool's dtype: "auto" (the model's) or a KV_CACHE_DTYPES key (quantized pages with
    # one key and one value scale per layer: runner/kv_scales.py says where those come from).
    cache_dtype: str = "auto"
    quantization_param_path: str | None = None  # a JSON file of the layers' KV scales
    calculate_kv_scales: bool = False  # measure them at start-up
    swap_space: float = 4.0  # GiB of host memory for preempted requests' pages (preemption_mode swap)
    cpu_offload_gb: float = 0.0  # GiB of each device's layer weights kept in host memory

    def kv_pool_dtype(self, model_dtype: str) -> str:
        return KV_CACHE_DTYPES.get(self.cache_dtype, model_dtype)


# The CPU's default KV pool (there is no device memory to measure there): 1 GiB holds 23k tokens
# of SmolLM2, several full contexts. Every byte is zero-filled at start-up, and a fresh VM pays
# for its first touch of host memory: 4 GiB cost 10-13 s of start-up on a 2-core VM.
CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority"
    preemption_mode: str = "recompute"
    long_prefill_token_threshold: int = 0
    # New prompts wait until the oldest waiting one has waited this many times the last prompt
    # step's length (vLLM's scheduler_delay_factor), so that more of them start together
    delay_factor: float = 0.0
    # Plan and dispatch step N+1 while the device runs step N (engine/llm_engine.py)
    async_scheduling: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages of consecutive layers, each on its own tp devices
    # MoE layers split whole experts over the "model" axis instead of slicing every expert
    enable_expert_parallel: bool = False


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapters one step may mix: the device's LoRA slots
    max_lora_rank: int = 16  # slots hold adapters of up to this rank
    max_cpu_loras: int | None = None  # adapters kept read in host memory (None: max_loras)
    bias: bool = False  # adapters may carry biases (PEFT's lora_bias: lora_B.bias)
    fully_sharded: bool = False  # tensor parallel: split the rank axis of both factors


@dataclass(frozen=True)
class CompilationConfig:
    enforce_eager: bool = False
    # Explicit bucket lists (None: derived from the scheduler limits in runner/bucketing.py).
    token_buckets: tuple[int, ...] | None = None
    seq_buckets: tuple[int, ...] | None = None
    min_token_bucket: int = 16  # smallest derived token bucket (1 on CPU, see runner/bucketing.py)
    # JAX persistent compilation cache: None = the default dir under ~/.cache, "" = off.
    cache_dir: str | None = None
    # The attention the step is traced with (layers/attention.py): "reference", "tpu", "gpu",
    # "tpu-interpret" or "gpu-interpret"; --attention-backend resolved for the platform.
    attention_backend: str = "reference"
    # Pipeline parallel: the rows below which a microbatch costs a stage the time it reads its
    # weights in (layers/pipeline.py picks the microbatches by it). 0: a step is never cut; None:
    # the chip's ridge point (StepLayout.plan).
    pipeline_microbatch_tokens: int | None = None

    def __post_init__(self):
        tokens = self.pipeline_microbatch_tokens
        if tokens is not None and (type(tokens) is not int or tokens < 0):
            raise ValueError(
                f"compilation_config pipeline_microbatch_tokens must be an integer >= 0, got {tokens!r}."
            )


# --structured-outputs-config backend values: llguidance is the one installed (the others need torch).
STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """How requests' structured outputs are compiled (vLLM's --structured-outputs-config and the
    older --guided-decoding-* flags)."""

    backend: str = "auto"  # "auto" or "guidance" (llguidance)
    disable_fallback: bool = False
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens
    disable_additional_properties: bool = False  # objects take only the properties the schema names
    # A reasoning parser (jaxserve/reasoning/) name: the constraint applies after the reasoning ends.
    reasoning_parser: str = ""


# --speculative-config methods jaxserve runs: proposals from the request's own tokens, on the host,
# or from a smaller model of the same vocabulary on the device.
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config): each decoding request is fed up to
    num_speculative_tokens proposed tokens after its last one, and the step keeps those its own
    sampling agrees with, plus one more (runner/step.py verify)."""

    method: str  # one of SPECULATIVE_METHODS
    num_speculative_tokens: int
    prompt_lookup_min: int = 5  # ngram: shortest suffix of the text matched earlier in it
    prompt_lookup_max: int = 5  # ngram: longest
    suffix_decoding_max_tree_depth: int = 24  # suffix: longest context matched and proposal made
    suffix_decoding_max_cached_requests: int = 10000  # suffix: finished outputs kept to match
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: proposal length <= factor x match length
    suffix_decoding_min_token_prob: float = 0.1  # suffix: stop at a continuation rarer than this
    # No proposals while more requests than this are running or waiting (vLLM's
    # disable_by_batch_size): a busy batch is decoded without them, and scheduled asynchronously
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft's directory or .gguf file
    quantization: str | None = None  # draft_model: the draft's --quantization
    draft_model_config: ModelConfig | None = None  # draft_model: the draft resolved at start-up


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    compilation_config: CompilationConfig
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora_config: LoRAConfig | None = None  # None: no LoRA slots
    otlp_traces_endpoint: str | None = None  # where request spans go (engine/tracing.py)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
