"""Tiny GGUF files for the loader tests, written the way llama.cpp's converter writes them.

The writer does what llama.cpp's ``convert_hf_to_gguf.py`` does to a Llama checkpoint (renaming,
permuting q/k rows, quantizing), so reading a file back must give the original tensors. The
model is the tiny Llama of tiny_models.py (its vocabulary and MLP sized here). Kept out of
conftest.py so test modules can import it under a name no other test directory uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gguf
import numpy as np
from tiny_models import TINY_LLAMA

from jaxserve.loader.gguf_blocks import unpermute_rows

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "o Ġ", "Ġ w", "Ġw o", "r l", "rl d", "i Ġ", "hell o"]

# HF parameter name -> GGUF tensor name, for one block.
BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


@dataclass
class TinyGguf:
    """A tiny llama GGUF on disk and what reading it must give back."""

    path: str
    config: dict
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # HF name -> expected float32


def byte_level_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: every byte is one printable character in the vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter applies to HF q/k rows (its ``LlamaModel.permute``)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gpt2_tokenizer_metadata() -> dict:
    """A byte-level BPE vocabulary (llama.cpp's ``gpt2`` tokenizer model, as SmolLM2 uses)."""
    tokens = SPECIAL_TOKENS + byte_level_tokens() + [m.replace(" ", "") for m in MERGES]
    types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": MERGES, "add_bos": False}


def llama_tokenizer_metadata() -> dict:
    """A sentencepiece vocabulary with byte fallback (llama.cpp's ``llama`` tokenizer model)."""
    pieces = ["\u2581", "\u2581h", "e", "l", "o", "\u2581hello", "\u2581w", "or", "ld", "\u2581world", "ll"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 2
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "add_bos": True}


def write_tiny_gguf(
    path: str,
    *,
    tied: bool,
    architecture: str = "llama",
    tokenizer: str = "gpt2",
    linear_rope_factor: float | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    seed: int = 0,
    ffn_down_type: gguf.GGMLQuantizationType | None = None,
    proj_type: gguf.GGMLQuantizationType | None = None,
) -> TinyGguf:
    """A 2-layer llama GGUF with a tokenizer: F32 tensors plus a Q8_0 embedding.

    ``extra_tensors`` are written under their GGUF names and are not expected back.
    ``ffn_down_type`` stores every ``ffn_down`` (rows of 256 values, one K-quant block) in
    that type: quantized from the float values where the gguf package can quantize it,
    else random blocks of that type (K-quants); either way the expected tensor is what the
    gguf package dequantizes the stored blocks to. ``proj_type`` stores every other attention
    and MLP projection quantized in that type (the gguf package quantizing), likewise.
    """
    rng = np.random.default_rng(seed)
    vocab_meta = gpt2_tokenizer_metadata() if tokenizer == "gpt2" else llama_tokenizer_metadata()
    tokens = vocab_meta["tokens"]
    hidden, layers = TINY_LLAMA["hidden_size"], TINY_LLAMA["num_hidden_layers"]
    heads, kv_heads = TINY_LLAMA["num_attention_heads"], TINY_LLAMA["num_key_value_heads"]
    rms_norm_eps, vocab = TINY_LLAMA["rms_norm_eps"], len(tokens)
    inter = 96 if ffn_down_type is None and proj_type is None else 256
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(np.float32(rms_norm_eps)),
        "rope_theta": 10000.0,
        "max_position_embeddings": TINY_LLAMA["max_position_embeddings"],
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(rms_norm_eps)
    writer.add_tokenizer_model(vocab_meta["model"])
    writer.add_token_list(tokens)
    writer.add_token_types(vocab_meta["types"])
    if "merges" in vocab_meta:
        writer.add_tokenizer_pre("default")
        writer.add_token_merges(vocab_meta["merges"])
    if "scores" in vocab_meta:
        writer.add_token_scores(vocab_meta["scores"])
    writer.add_add_bos_token(vocab_meta["add_bos"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    if linear_rope_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(linear_rope_factor)

    expected: dict[str, np.ndarray] = {}

    def add(hf_name: str, gguf_name: str, value: np.ndarray, heads_to_permute: int = 0) -> None:
        expected[hf_name] = value
        stored = llama_cpp_permute(value, heads_to_permute) if heads_to_permute else value
        if proj_type is not None and value.ndim == 2 and "layers" in hf_name:
            blocks = gguf.quants.quantize(np.ascontiguousarray(stored), proj_type)
            writer.add_tensor(gguf_name, blocks, raw_dtype=proj_type)
            value = gguf.quants.dequantize(blocks, proj_type)
            expected[hf_name] = (
                unpermute_rows(value, heads_to_permute, hf_name, path) if heads_to_permute else value
            )
            return
        writer.add_tensor(gguf_name, np.ascontiguousarray(stored))

    embed = rng.standard_normal((vocab, hidden), dtype=np.float32)
    q8 = gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # shape from bytes
    expected["model.embed_tokens.weight"] = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)

    shapes = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (heads * head_dim, hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    permute_heads = {"self_attn.q_proj.weight": heads, "self_attn.k_proj.weight": kv_heads}
    for layer in range(layers):
        for hf_suffix, gguf_suffix in BLOCK_NAMES.items():
            value = rng.standard_normal(shapes[hf_suffix], dtype=np.float32)
            if ffn_down_type is not None and hf_suffix == "mlp.down_proj.weight":
                blocks = _blocks_of_type(value, ffn_down_type, rng)
                writer.add_tensor(f"blk.{layer}.{gguf_suffix}", blocks, raw_dtype=ffn_down_type)
                expected[f"model.layers.{layer}.{hf_suffix}"] = gguf.quants.dequantize(blocks, ffn_down_type)
                continue
            add(
                f"model.layers.{layer}.{hf_suffix}",
                f"blk.{layer}.{gguf_suffix}",
                value,
                permute_heads.get(hf_suffix, 0),
            )
    add("model.norm.weight", "output_norm.weight", rng.standard_normal(hidden, dtype=np.float32))
    if not tied:
        add("lm_head.weight", "output.weight", rng.standard_normal((vocab, hidden), dtype=np.float32))
    for gguf_name, value in (extra_tensors or {}).items():
        writer.add_tensor(gguf_name, value)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGguf(path=path, config=config, tensors=expected)


def _blocks_of_type(value: np.ndarray, qtype: gguf.GGMLQuantizationType, rng) -> np.ndarray:
    try:
        return gguf.quants.quantize(value, qtype)
    except NotImplementedError:  # K-quants: the gguf package only dequantizes them
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        shape = (value.shape[0], value.shape[1] // block_size * type_size)
        blocks = rng.integers(0, 256, size=shape, dtype=np.uint8)
        # Keep the float16 super-block scales finite: random bytes could spell inf or NaN.
        half_scales = blocks.view(np.float16)
        half_scales[~np.isfinite(half_scales)] = 0
        return blocks


def write_gguf_from_hf(path: str, hf_model, architecture: str) -> None:
    """An F32 GGUF of a transformers Llama-family model, as llama.cpp's converter writes it:
    GGUF names, q/k rows permuted for the llama architecture only (qwen2 keeps HF's order),
    biases as ``.bias`` tensors, a byte-level tokenizer."""
    cfg = hf_model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = gpt2_tokenizer_metadata()
    writer.add_tokenizer_model(vocab["model"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_tokenizer_pre("default")
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    to_gguf = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    permute = {"attn_q": heads, "attn_k": kv_heads} if architecture == "llama" else {}
    state = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, value in state.items():
        if hf_name in to_gguf:
            gguf_name = to_gguf[hf_name]
        else:
            _, _, layer, *rest = hf_name.split(".")
            suffix = ".".join(rest)
            kind = suffix.rsplit(".", 1)[0]
            gguf_stem = BLOCK_NAMES[kind + ".weight"].rsplit(".", 1)[0]
            gguf_name = f"blk.{layer}.{gguf_stem}.{suffix.rsplit('.', 1)[1]}"
            if gguf_stem in permute:
                value = llama_cpp_permute(value, permute[gguf_stem])
        writer.add_tensor(gguf_name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
