"""Engine arguments with vLLM's names and defaults -> the frozen EngineConfig.

`EngineArgs` is what `LLM(**kwargs)` and the command line fill in. `create_engine_config`
resolves everything that depends on the model (its config, dtype, length) once, and
refuses any value it cannot honour with a ValueError that names the argument.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import jax

from jaxserve.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

DTYPES = {
    "auto": None,
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


def parse_model_len(value: int | str | None) -> int | None:
    """vLLM's human-friendly lengths: 1k = 1000, 1K = 1024, 25.6k = 25600."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(value))
    if not m:
        raise ValueError(f"max_model_len {value!r} is not a length (e.g. 2048, 1k, 1K, 25.6k).")
    number, suffix = float(m.group(1)), m.group(2)
    scale = {"": 1, "k": 1000, "K": 1024, "m": 10**6, "M": 1 << 20, "g": 10**9, "G": 1 << 30}[suffix]
    return int(number * scale)


def _as_dict(value: Any, name: str) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}.")
    return value


def _platform() -> str:
    return jax.devices()[0].platform


def resolve_model_path(model: str | None, revision: str | None = None) -> str:
    """A local directory or .gguf file for `model`; hub ids resolve from the local HF cache only."""
    if model is None:
        from jaxserve.loader.default_model import default_model_path

        return default_model_path()
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:
        raise ValueError(
            f"model {model!r} is neither a local path (directory or .gguf file) nor in the local "
            "Hugging Face cache; jaxserve does not download models."
        ) from None


def _checkpoint_dtype(hf_config: dict) -> str:
    name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32").replace("torch.", "")
    return {"float": "float32", "half": "float16"}.get(name, name)


@dataclass
class EngineArgs:
    model: str | None = None
    served_model_name: str | list[str] | None = None
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    revision: str | None = None
    tokenizer_revision: str | None = None
    trust_remote_code: bool = False
    hf_overrides: dict | str | None = None
    dtype: str = "auto"
    max_model_len: int | str | None = None
    seed: int = 0
    load_format: str = "auto"
    use_tqdm_on_load: bool = True
    generation_config: str = "auto"
    override_generation_config: dict | str | None = None
    max_logprobs: int = 20
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False
    max_seq_len_to_capture: int = 8192
    compilation_config: dict | str | None = None
    block_size: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "builtin"
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"extra"}

    def _check_choices(self) -> None:
        choices = {
            "dtype": tuple(DTYPES),
            "load_format": LOAD_FORMATS,
            "tokenizer_mode": ("auto", "slow"),
            "kv_cache_dtype": ("auto",),
            "prefix_caching_hash_algo": ("builtin", "sha256"),
            "scheduling_policy": ("fcfs", "priority"),
            "preemption_mode": ("recompute",),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported; choose from {list(allowed)}."
                )
        if self.block_size is not None and self.block_size not in BLOCK_SIZES:
            raise ValueError(
                f"block_size={self.block_size} is not supported; choose from {list(BLOCK_SIZES)}."
            )
        positive = ("max_num_seqs", "tensor_parallel_size", "max_logprobs", "max_seq_len_to_capture")
        for name in positive + ("max_num_batched_tokens", "num_gpu_blocks_override"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2 (one page is reserved for padding).")
        for name in ("data_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) != 1:
                raise ValueError(f"{name}={getattr(self, name)} is not supported by jaxserve yet (only 1).")
        if self.tensor_parallel_size > len(jax.devices()):
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs that many devices; "
                f"{len(jax.devices())} visible."
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0.")
        if self.extra:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(self.extra))}.")

    def _model_config(self) -> ModelConfig:
        path = resolve_model_path(self.model, self.revision)
        load_format = self.load_format
        is_gguf = os.path.isfile(path) and path.endswith(".gguf")
        if is_gguf:
            from jaxserve.loader.gguf import read_gguf_config

            hf_config = read_gguf_config(path)
            if load_format == "auto":
                load_format = "gguf"
        elif os.path.isdir(path):
            from jaxserve.loader.safetensors import read_hf_config

            hf_config = read_hf_config(path)
            if load_format == "auto":
                load_format = "safetensors"
        else:
            raise ValueError(f"model {path!r} is neither a model directory nor a .gguf file.")
        if load_format == "gguf" and not is_gguf:
            raise ValueError(f"load_format='gguf' needs a .gguf file, got {path!r}.")
        hf_config = {**hf_config, **_as_dict(self.hf_overrides, "hf_overrides")}

        from jaxserve.models.registry import resolve_architecture

        resolve_architecture(hf_config)  # refuse unknown architectures before anything loads
        if self.dtype == "auto":
            dtype = "float32" if _platform() == "cpu" else _checkpoint_dtype(hf_config)
            if dtype == "float32" and _platform() != "cpu":
                dtype = "bfloat16"
        else:
            dtype = DTYPES[self.dtype]
        derived_len = int(hf_config.get("max_position_embeddings") or 2048)
        requested = parse_model_len(self.max_model_len)
        max_model_len = derived_len if requested is None else requested
        if max_model_len < 2 or max_model_len > derived_len:
            raise ValueError(
                f"max_model_len={max_model_len} must be between 2 and the model's maximum length "
                f"({derived_len}, max_position_embeddings)."
            )
        names = self.served_model_name
        if names is None:
            names = [self.model or "HuggingFaceTB/SmolLM2-135M-Instruct"]
        elif isinstance(names, str):
            names = [names]
        return ModelConfig(
            model=path,
            tokenizer=self.tokenizer or path,
            load_format=load_format,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=self.seed,
            hf_config=MappingProxyType(hf_config),
            served_model_name=tuple(names),
            tokenizer_revision=self.tokenizer_revision,
            revision=self.revision,
            trust_remote_code=self.trust_remote_code,
            generation_config=self.generation_config,
            override_generation_config=MappingProxyType(
                _as_dict(self.override_generation_config, "override_generation_config")
            ),
            max_logprobs=self.max_logprobs,
            skip_tokenizer_init=self.skip_tokenizer_init,
            use_tqdm_on_load=self.use_tqdm_on_load,
        )

    def create_engine_config(self) -> EngineConfig:
        self._check_choices()
        model_config = self._model_config()
        max_len = model_config.max_model_len
        batched = self.max_num_batched_tokens or (2048 if _platform() == "cpu" else 8192)
        if not self.enable_chunked_prefill and batched < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) is smaller than max_model_len ({max_len}) with chunked "
                "prefill disabled: a long prompt could never be scheduled. Raise it or enable chunked prefill."
            )
        if batched < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) must be >= max_num_seqs ({self.max_num_seqs})."
            )
        comp = _as_dict(self.compilation_config, "compilation_config")
        unknown = set(comp) - {"token_buckets", "seq_buckets", "cache_dir"}
        if unknown:
            raise ValueError(f"compilation_config keys {sorted(unknown)} are not supported.")
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size or 16,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                swap_space=self.swap_space,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=batched,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
                preemption_mode=self.preemption_mode,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            compilation_config=CompilationConfig(
                enforce_eager=self.enforce_eager,
                max_seq_len_to_capture=self.max_seq_len_to_capture,
                token_buckets=tuple(comp["token_buckets"]) if "token_buckets" in comp else None,
                seq_buckets=tuple(comp["seq_buckets"]) if "seq_buckets" in comp else None,
                cache_dir=comp.get("cache_dir"),
            ),
        )
