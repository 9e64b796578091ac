"""GGUF files (llama.cpp's one-file checkpoints) -> Hugging Face config, tensors and tokenizer.

Where it sits: the loader layer, beside ``safetensors.py``. It translates a GGUF into exactly what a
Hugging Face directory would have given: a ``config.json``-style dict for the model registry, a
``(hf_name, float32 array)`` stream in Hugging Face names and layouts for the weight loader, and a
transformers fast tokenizer (with the file's chat template) for tokenization and detokenization.
Nothing downstream needs to know the weights came from a GGUF.

Quantized blocks are dequantized to float32 here, once, on the host; the model then casts to its
serving dtype like any other checkpoint. The decoder projections whose every layer is stored in
Q8_0, or every layer in Q4_0 / Q4_1 / Q4_K, and an embedding table in Q8_0, can instead be read
as their groups (`GroupQuantized`: integer values, a scale and a min per 32 inputs) to be served
quantized (layers/linear.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField
from tqdm import tqdm

from jaxserve.config import jaxserve_cache_dir
from jaxserve.loader import file_cache
from jaxserve.loader.fast_tokenizer import FastTokenizer
from jaxserve.loader.gguf_blocks import GroupQuantized, dequantize_tensor, group_blocks, unpermute_rows
from jaxserve.loader.gguf_tokenizer import (
    TOKENIZER_BUILD_VERSION,
    GGUFTokenizerMetadata,
    build_gguf_tokenizer,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Architecture:
    """What differs between GGUF architectures that share Llama's tensor naming."""

    hf_architecture: str
    model_type: str
    # llama.cpp's converter reorders each q/k head's rows for its interleaved rope; HF rotates halves.
    permute_qk: bool


_ARCHITECTURES: dict[str, _Architecture] = {
    "llama": _Architecture(hf_architecture="LlamaForCausalLM", model_type="llama", permute_qk=True),
    # llama.cpp converts Qwen2 without the q/k reordering: its rope for qwen2 rotates halves.
    "qwen2": _Architecture(hf_architecture="Qwen2ForCausalLM", model_type="qwen2", permute_qk=False),
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Present in some files but not parameters of the HF model. rope_freqs carries Llama-3.1's rope
# scaling as per-dimension factors; HF expresses that in config.rope_scaling, which GGUF omits.
_SKIPPED_TENSORS = {"rope_freqs": "per-dimension rope factors are not applied", "attn_rot_embd": "unused"}


class _PlainArrayReader(GGUFReader):
    """GGUFReader that parses its header through a plain ndarray view of the memory map.

    Why: GGUFReader does two small slices per metadata string, and every np.memmap slice pays for
    memmap.__getitem__/__array_finalize__. With a 49k-token vocabulary and 49k merges that is ~5.5 s
    per open of SmolLM2; through a plain view it is ~1.3 s. The view keeps the map alive via .base.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


def read_gguf_config(path: str) -> dict:
    """A Hugging Face ``LlamaConfig``-style dict built from the file's metadata (kept in the file
    cache: a warm start then never parses the header)."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    config = file_cache.read_json(path, "config")
    if config is None:
        config = _hf_config(_open(path), path)
        file_cache.write_json(path, "config", config)
    return config


_Q = GGMLQuantizationType
_GROUP_FORMATS = {_Q.Q8_0: "q8", _Q.Q4_0: "q4", _Q.Q4_1: "q4", _Q.Q4_K: "q4"}


def gguf_kernel_formats(path: str) -> dict[str, str]:
    """HF projection names (``self_attn.q_proj`` ...) whose tensors are group-quantized in the
    same format ("q8" or "q4") in every layer, with a multiple of 64 inputs a row for 4 bits, and
    ``model.embed_tokens`` when the embedding table is in Q8_0.
    Kept in the file cache: a warm start never parses the header."""
    formats = file_cache.read_json(path, "kernel-formats")
    if formats is None:
        formats = _kernel_formats(_open(path))
        file_cache.write_json(path, "kernel-formats", formats)
    return formats


def _kernel_formats(reader: GGUFReader) -> dict[str, str]:
    seen: dict[str, set[str | None]] = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_TENSORS and parts[3] == "weight":
            fmt = _GROUP_FORMATS.get(tensor.tensor_type)
            if fmt == "q4" and int(tensor.shape[0]) % 64:
                fmt = None
            seen.setdefault(_BLOCK_TENSORS[parts[2]], set()).add(fmt)
        elif tensor.name == "token_embd.weight" and tensor.tensor_type == _Q.Q8_0:  # rows of 32s
            seen[_GLOBAL_TENSORS["token_embd"]] = {"q8"}
    return {name: fmts.pop() for name, fmts in seen.items() if len(fmts) == 1 and None not in fmts}


def iter_gguf_tensors(
    path: str, use_tqdm: bool = True, grouped: frozenset[str] = frozenset()
) -> Iterator[tuple[str, np.ndarray | GroupQuantized]]:
    """Every model tensor as ``(hf_name, float32 array)`` in Hugging Face layout, in file order;
    the projections named in `grouped` (as gguf_kernel_formats names them) as GroupQuantized.

    The file is opened and every tensor name checked before the first tensor is yielded, so a bad
    file fails at the call, not halfway through loading.
    """
    reader = _open(path)
    arch = _architecture(reader, path)
    config = _hf_config(reader, path)
    names = [_hf_tensor_name(tensor.name, path) for tensor in reader.tensors]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    return _iter_tensors(reader, names, arch, heads, path, use_tqdm, grouped)


def load_gguf_tokenizer(path: str) -> FastTokenizer:
    """A fast tokenizer rebuilt from the file's vocabulary, merges and special tokens.

    Built with the ``tokenizers`` library (``gguf_tokenizer.py``), never through transformers' GGUF
    loader, which needs torch, nor through transformers at all; the tests check it id for id against
    that loader. A ``tokenizer.json`` that sits beside the file is ignored: it may belong to another
    model, and a .gguf's tokenizer comes from the .gguf.
    """
    # Parsing the vocabulary and merges takes a second or two; a converted copy keyed by the file's
    # identity (absolute path, size, modification time) and the builder's version loads in a fraction.
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    model_dir = os.path.dirname(os.path.abspath(path))
    stat = os.stat(path)
    where = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    key = f"{os.path.basename(path)}-{stat.st_size}-{stat.st_mtime_ns}-{where}-v{TOKENIZER_BUILD_VERSION}"
    cached = jaxserve_cache_dir("tokenizers", key)
    if os.path.isdir(cached):
        try:
            return FastTokenizer.from_directory(cached, name_or_path=model_dir)
        except Exception:  # a damaged cache entry is rebuilt below
            logger.warning("Rebuilding the cached tokenizer of %s", path)
    try:
        tokenizer = build_gguf_tokenizer(read_gguf_tokenizer_metadata(path), name_or_path=model_dir)
    except ValueError as err:
        raise ValueError(f"{path}: could not build a tokenizer from its metadata ({err})") from err
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(cached)) as tmp:
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, cached)
            os.makedirs(tmp)  # TemporaryDirectory removes its path on exit
    except OSError as err:  # a read-only cache only costs time
        logger.warning("Could not cache the tokenizer of %s: %s", path, err)
    return tokenizer


def read_gguf_tokenizer_metadata(path: str) -> GGUFTokenizerMetadata:
    """The file's ``tokenizer.*`` keys; ValueError (naming the file) if it carries no tokenizer."""
    reader = _open(path)
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ValueError(f"{path}: has no tokenizer in its metadata (no tokenizer.ggml.tokens)")

    def get(key: str) -> Any:
        return _field(reader, key)

    return GGUFTokenizerMetadata(
        model=get("tokenizer.ggml.model"),
        tokens=get("tokenizer.ggml.tokens"),
        token_types=get("tokenizer.ggml.token_type") or [],
        merges=get("tokenizer.ggml.merges"),
        scores=get("tokenizer.ggml.scores"),
        pre=get("tokenizer.ggml.pre"),
        bos_token_id=get("tokenizer.ggml.bos_token_id"),
        eos_token_id=get("tokenizer.ggml.eos_token_id"),
        unknown_token_id=get("tokenizer.ggml.unknown_token_id"),
        padding_token_id=get("tokenizer.ggml.padding_token_id"),
        add_bos_token=get("tokenizer.ggml.add_bos_token"),
        add_eos_token=get("tokenizer.ggml.add_eos_token"),
        chat_template=get("tokenizer.chat_template"),
    )


def _open(path: str) -> GGUFReader:
    """The file's parsed header, shared by the config, tensor and tokenizer readers of one
    start-up: parsing SmolLM2's (a 49k vocabulary, 49k merges) takes about a second."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    stat = os.stat(path)
    return _open_version(os.path.abspath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_version(path: str, inode: int, size: int, mtime_ns: int) -> GGUFReader:
    """One reader per version of a file (a rewritten file has a new size, time or inode)."""
    try:
        return _PlainArrayReader(path)
    except Exception as err:  # gguf signals bad/truncated input with bare numpy errors
        raise ValueError(f"{path}: not a valid GGUF file or truncated ({err})") from err


def _architecture(reader: GGUFReader, path: str) -> _Architecture:
    name = _field(reader, "general.architecture")
    if name not in _ARCHITECTURES:
        supported = ", ".join(sorted(_ARCHITECTURES))
        raise ValueError(f"{path}: GGUF architecture {name!r} is not supported (supported: {supported})")
    return _ARCHITECTURES[name]


def _hf_config(reader: GGUFReader, path: str) -> dict:
    arch = _architecture(reader, path)
    prefix = _field(reader, "general.architecture")

    def required(key: str) -> Any:
        value = _field(reader, f"{prefix}.{key}")
        if value is None:
            raise ValueError(f"{path}: metadata key {prefix}.{key} is missing")
        return value

    hidden_size = required("embedding_length")
    num_heads = required("attention.head_count")
    num_kv_heads = _field(reader, f"{prefix}.attention.head_count_kv", num_heads)
    # key_length is the true head size when present; rope.dimension_count equals it for llama.
    head_dim = _field(
        reader, f"{prefix}.attention.key_length", _field(reader, f"{prefix}.rope.dimension_count")
    )
    tensor_names = {tensor.name for tensor in reader.tensors}

    config: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "hidden_size": hidden_size,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim if head_dim is not None else hidden_size // num_heads,
        "rms_norm_eps": required("attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, f"{prefix}.rope.freq_base", 10000.0),
        "max_position_embeddings": required("context_length"),
        "vocab_size": _vocab_size(reader, prefix, path),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        gguf_key = "tokenizer.ggml." + key.replace("pad_", "padding_")
        if (token_id := _field(reader, gguf_key)) is not None:
            config[key] = token_id
    if (rope_scaling := _rope_scaling(reader, prefix)) is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _vocab_size(reader: GGUFReader, prefix: str, path: str) -> int:
    """The embedding's row count first: it is what the weights have; the metadata key is optional."""
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF lists dimensions fastest first: [hidden, vocab]
    if (size := _field(reader, f"{prefix}.vocab_size")) is not None:
        return size
    if (tokens := reader.fields.get("tokenizer.ggml.tokens")) is not None:
        return len(tokens.data)
    raise ValueError(f"{path}: cannot tell the vocabulary size (no vocab_size, token_embd or tokens)")


def _rope_scaling(reader: GGUFReader, prefix: str) -> dict | None:
    kind = _field(reader, f"{prefix}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "factor": _field(reader, f"{prefix}.rope.scaling.factor", 1.0),
    }
    original = _field(reader, f"{prefix}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    attn_factor = _field(reader, f"{prefix}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = attn_factor
    return scaling


def _hf_tensor_name(gguf_name: str, path: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None to skip."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise ValueError(f"{path}: unexpected tensor {gguf_name!r}")
    if stem in _SKIPPED_TENSORS:
        logger.warning("%s: skipping %s (%s)", path, gguf_name, _SKIPPED_TENSORS[stem])
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        if parts[2] in _SKIPPED_TENSORS:
            return None
        if parts[2] in _BLOCK_TENSORS:
            return f"model.layers.{parts[1]}.{_BLOCK_TENSORS[parts[2]]}.{suffix}"
    raise ValueError(f"{path}: tensor {gguf_name!r} has no Hugging Face counterpart in this loader")


def _iter_tensors(
    reader: GGUFReader,
    names: list[str | None],
    arch: _Architecture,
    heads: dict[str, int],
    path: str,
    use_tqdm: bool,
    grouped: frozenset[str],
) -> Iterator[tuple[str, np.ndarray | GroupQuantized]]:
    tensors = tqdm(reader.tensors, desc="Loading GGUF", unit="tensor", disable=not use_tqdm)
    for tensor, hf_name in zip(tensors, names, strict=True):
        if hf_name is None:
            continue
        kind = tensor.name.split(".")[-2]
        if hf_name.endswith(".weight") and ".".join(hf_name.split(".")[-3:-1]) in grouped:
            weights = group_blocks(tensor, path)
            if arch.permute_qk and kind in heads:  # rows are output channels in every part
                n, name = heads[kind], tensor.name
                weights = weights.map(lambda a, n=n, name=name: unpermute_rows(a, n, name, path))
            yield hf_name, weights
            continue
        weights = dequantize_tensor(tensor, path)
        if arch.permute_qk and kind in heads:
            weights = unpermute_rows(weights, heads[kind], tensor.name, path)
        yield hf_name, weights


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else _field_value(field)


def _field_value(field: ReaderField) -> Any:
    """A metadata value as plain Python (str, int, float, bool, or a list of them)."""
    if field.types[0] == GGUFValueType.ARRAY:
        item_type = field.types[-1]
        return [_scalar(field.parts[i], item_type) for i in field.data]
    return _scalar(field.parts[field.data[0]], field.types[0])


def _scalar(part: np.ndarray, value_type: GGUFValueType) -> Any:
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]
