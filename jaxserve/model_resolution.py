"""From `--model` and its companion flags to a ModelConfig: which files, which format, which config.

Where it sits: called once by `EngineArgs.create_engine_config` (args.py), before anything loads.
It finds the model on this machine (a directory, a .gguf file, the local Hugging Face cache or the
default model; jaxserve never downloads at run time), picks the load format, reads the HF config
(from config.json or the GGUF header) with `--hf-overrides` and the rope flags applied, refuses an
architecture the registry lacks, and settles the serving dtype and max_model_len.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
from types import MappingProxyType

from jaxserve.config import ModelConfig
from jaxserve.flags import as_dict, parse_model_len

logger = logging.getLogger(__name__)

DTYPES = {
    "auto": None,
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}


# Devices a configuration is being built for instead of this process's own (see `targeting`)
_TARGET_DEVICES: list | None = None


def devices() -> list:
    """The devices the engine's configuration is for: this process's, unless `targeting` others."""
    if _TARGET_DEVICES is not None:
        return _TARGET_DEVICES
    import jax

    return jax.devices()


def platform() -> str:
    """The platform of the first device (cpu, tpu, gpu): it picks dtype and size defaults."""
    return devices()[0].platform


@contextlib.contextmanager
def targeting(target_devices: list):
    """Build configurations for `target_devices` (e.g. a TPU topology's, which this process only
    compiles for): the platform's defaults and device counts are theirs while inside."""
    global _TARGET_DEVICES
    previous, _TARGET_DEVICES = _TARGET_DEVICES, list(target_devices)
    try:
        yield
    finally:
        _TARGET_DEVICES = previous


def resolve_model_path(
    model: str | None, revision: str | None = None, download_dir: str | None = None
) -> str:
    """A local directory or .gguf file for `model`; hub ids resolve from the local HF cache only
    (`download_dir` when given, as vLLM's --download-dir)."""
    if model is None:
        from jaxserve.loader.default_model import default_model_path

        try:
            return default_model_path()
        except RuntimeError as err:  # no network, say: the message says what to do instead
            raise ValueError(str(err)) from err
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
    except Exception:
        raise ValueError(
            f"model {model!r} is neither a local path (directory or .gguf file) nor in the local "
            "Hugging Face cache; jaxserve does not download models."
        ) from None


def _checkpoint_dtype(hf_config: dict) -> str:
    name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32").replace("torch.", "")
    return {"float": "float32", "half": "float16"}.get(name, name)


def _with_rope_flags(hf_config: dict, rope_scaling: dict, rope_theta: float | None) -> dict:
    """--rope-scaling replaces the config's scaling and --rope-theta its base, as vLLM does.

    Both spellings are written: the older `rope_scaling`/`rope_theta` and transformers 5's
    `rope_parameters`, which rotary.py prefers when a checkpoint has it.
    """
    hf_config = dict(hf_config)
    params = dict(hf_config.get("rope_parameters") or {})
    if rope_scaling:
        hf_config["rope_scaling"] = dict(rope_scaling)
        if params:
            kept = {k: params[k] for k in ("rope_theta", "partial_rotary_factor") if k in params}
            params = {**kept, **rope_scaling}
    if rope_theta is not None:
        hf_config["rope_theta"] = float(rope_theta)
        if params:
            params["rope_theta"] = float(rope_theta)
    if params:
        hf_config["rope_parameters"] = params
    return hf_config


def _with_text_config(hf_config: dict) -> dict:
    """A vision-language config's text part lifted to the top level, where everything that reads
    a decoder's settings looks (the name, type and vision parts stay the model's own)."""
    text = hf_config.get("text_config")
    if not isinstance(text, dict) or "vision_config" not in hf_config:
        return hf_config
    keep = {k: hf_config[k] for k in ("architectures", "model_type") if k in hf_config}
    return {**hf_config, **text, **keep}


def _mm_limits(value) -> dict[str, int]:
    """--limit-mm-per-prompt as vLLM takes it: {"image": 2}, or {"image": {"count": 2, ...}}."""
    limits = {}
    for modality, limit in as_dict(value, "limit_mm_per_prompt").items():
        count = limit.get("count") if isinstance(limit, dict) else limit
        if modality not in ("image", "video", "audio") or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"limit_mm_per_prompt: {modality!r}: {limit!r} is not a modality (image, video, audio) "
                "with a count >= 0."
            )
        limits[modality] = count
    return limits


def _check_ignore_patterns(ignore_patterns, path: str, is_gguf: bool) -> None:
    patterns = [ignore_patterns] if isinstance(ignore_patterns, str) else ignore_patterns
    if not patterns:
        return
    if is_gguf:
        weights = [os.path.basename(path)]
    else:
        weights = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    for name in weights:
        if any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
            raise ValueError(f"--ignore-patterns {patterns} exclude {name}, a weight file of the model.")


def model_config_from_args(args) -> ModelConfig:
    """The ModelConfig that engine arguments (`args`: an EngineArgs) ask for: the model resolved to a
    local path and load format, its HF config with the overrides and rope flags applied, the
    serving dtype and length. ValueError, naming the flag, for what cannot be served."""
    path = resolve_model_path(args.model, args.revision, args.download_dir)
    load_format = args.load_format
    is_gguf = os.path.isfile(path) and path.endswith(".gguf")
    if is_gguf:
        if load_format == "auto":
            load_format = "gguf"
    elif os.path.isdir(path):
        from jaxserve.loader.orbax import is_orbax_dir

        if load_format == "auto":
            load_format = "orbax" if is_orbax_dir(path) else "safetensors"
        elif load_format == "orbax" and not is_orbax_dir(path):
            raise ValueError(
                f"load_format='orbax' needs a directory made by `jaxserve convert`, got {path!r}."
            )
    else:
        raise ValueError(f"model {path!r} is neither a model directory nor a .gguf file.")
    if load_format == "gguf" and not is_gguf:
        raise ValueError(f"load_format='gguf' needs a .gguf file, got {path!r}.")
    if args.quantization == "gguf" and not is_gguf:
        raise ValueError(f"quantization='gguf' needs a .gguf file, got {path!r}.")
    _check_ignore_patterns(args.ignore_patterns, path, is_gguf)
    if args.hf_config_path is not None:
        from jaxserve.loader.safetensors import read_hf_config

        hf_config = read_hf_config(resolve_model_path(args.hf_config_path, args.revision, args.download_dir))
    elif is_gguf:
        from jaxserve.loader.gguf import read_gguf_config

        hf_config = read_gguf_config(path)
    else:
        from jaxserve.loader.safetensors import read_hf_config

        hf_config = read_hf_config(path)
    hf_config = {**_with_text_config(hf_config), **as_dict(args.hf_overrides, "hf_overrides")}
    hf_config = _with_rope_flags(hf_config, as_dict(args.rope_scaling, "rope_scaling"), args.rope_theta)

    from jaxserve.models.registry import resolve_architecture

    resolve_architecture(hf_config)  # refuse unknown architectures before anything loads
    from jaxserve.pooler_resolution import runner_and_pooler

    runner_type, pooler_config = runner_and_pooler(args, path, hf_config)
    checkpoint_quantization = None if is_gguf else _checkpoint_quantization(hf_config, args.quantization)
    quantization = (
        None if checkpoint_quantization else _weight_quantization(hf_config, args.quantization, is_gguf)
    )
    if args.dtype == "auto":
        dtype = "float32" if platform() == "cpu" else _checkpoint_dtype(hf_config)
        if dtype == "float32" and platform() != "cpu":
            dtype = "bfloat16"
    else:
        dtype = DTYPES[args.dtype]
    from jaxserve.layers.rotary import max_len_with_rope_scaling

    derived_len, source = max_len_with_rope_scaling(hf_config)
    from jaxserve.models.bert import encoder_max_len

    if encoder_max_len(hf_config) is not None:
        derived_len, source = encoder_max_len(hf_config), "max_position_embeddings of an encoder"
    window = hf_config.get("sliding_window")
    if args.disable_sliding_window and window and int(window) < derived_len:
        derived_len, source = int(window), "sliding_window"
    requested = parse_model_len(args.max_model_len)
    max_model_len = derived_len if requested is None else requested
    if max_model_len < 2 or max_model_len > derived_len:
        raise ValueError(
            f"max_model_len={max_model_len} must be between 2 and the model's maximum length "
            f"({derived_len}, {source})."
        )
    names = args.served_model_name
    if names is None:
        names = [args.model or "HuggingFaceTB/SmolLM2-135M-Instruct"]
    elif isinstance(names, str):
        names = [names]
    return ModelConfig(
        model=path,
        tokenizer=args.tokenizer or path,
        load_format=load_format,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=args.seed,
        hf_config=MappingProxyType(hf_config),
        served_model_name=tuple(names),
        tokenizer_revision=args.tokenizer_revision,
        trust_remote_code=args.trust_remote_code,
        generation_config=args.generation_config,
        override_generation_config=MappingProxyType(
            as_dict(args.override_generation_config, "override_generation_config")
        ),
        max_logprobs=args.max_logprobs,
        skip_tokenizer_init=args.skip_tokenizer_init,
        use_tqdm_on_load=args.use_tqdm_on_load,
        enable_sleep_mode=args.enable_sleep_mode,
        enable_prompt_embeds=args.enable_prompt_embeds,
        limit_mm_per_prompt=MappingProxyType(_mm_limits(args.limit_mm_per_prompt)),
        mm_processor_kwargs=MappingProxyType(as_dict(args.mm_processor_kwargs, "mm_processor_kwargs")),
        mm_cache_bytes=0 if args.disable_mm_preprocessor_cache else 1 << 30,
        allowed_local_media_path=args.allowed_local_media_path,
        quantization=quantization,
        checkpoint_quantization=checkpoint_quantization,
        runner_type=runner_type,
        pooler_config=pooler_config,
    )


# quantization_config.quant_method of a directory that `jaxserve convert --quantization M` wrote
CONVERTED_QUANT_METHOD = "jaxserve-{}"


def _checkpoint_quantization(hf_config: dict, flag: str | None) -> str | None:
    """The method of a checkpoint another tool quantized ("fp8", "compressed-tensors": served
    from its own values, loader/prequantized.py), or None. --quantization may repeat it."""
    from jaxserve.loader.prequantized import METHODS, checkpoint_scheme

    config = hf_config.get("quantization_config") or {}
    method = config.get("quant_method")
    if method not in METHODS:
        return None
    scheme = checkpoint_scheme(config)  # ValueError for what cannot be read
    if flag not in (None, method):
        raise ValueError(
            f"--quantization {flag} does not match the checkpoint, which is quantized with {method}."
        )
    logger.info(
        "The checkpoint's %s weights are served as stored (%s)%s",
        scheme.weights,
        method,
        "; its activation scales are not applied (activations stay unquantized)"
        if scheme.activations
        else "",
    )
    return method


def _weight_quantization(hf_config: dict, flag: str | None, is_gguf: bool) -> str | None:
    """The weight quantization to serve with ("int8", "fp8", "gguf" or None): --quantization's,
    what a converted checkpoint was saved with, or a GGUF file's own groups unless `none` asks
    for it dequantized. A checkpoint quantized by a method jaxserve cannot serve is refused,
    naming the method."""
    if is_gguf and flag in (None, "gguf"):
        return "gguf"
    from jaxserve.layers.linear import WEIGHT_QUANTIZATIONS

    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    saved = next(
        (q for q in (*WEIGHT_QUANTIZATIONS, "gguf") if method == CONVERTED_QUANT_METHOD.format(q)), None
    )
    if method is not None and saved is None:
        raise ValueError(
            f"The checkpoint is quantized with {method!r} (config.json quantization_config), which "
            f"jaxserve cannot serve yet; supported: unquantized checkpoints with --quantization "
            f"{' or '.join(WEIGHT_QUANTIZATIONS)}, and GGUF files."
        )
    if saved is not None:  # (a converted GGUF keeps its groups)
        if flag not in (None, saved):
            raise ValueError(
                f"--quantization {flag} does not match the checkpoint, which was converted with "
                f"--quantization {saved}."
            )
        return saved
    if flag == "fp8" and platform() == "cpu":  # measured in benchmarks/quantization.py
        logger.warning(
            "fp8 weights are converted in software on the CPU: decoding is several times slower "
            "than with float32 weights; --quantization int8 is the CPU's faster choice."
        )
    return flag if flag in WEIGHT_QUANTIZATIONS else None
