"""BERT and RoBERTa / XLM-RoBERTa encoders (bge, e5, gte, MiniLM, bge-m3 shapes), served for
pooling: the OPT port run as an encoder (models/opt.py `bidirectional`): post-LN layers with
biases and GELU, learned absolute positions (RoBERTa's table starts at padding_idx + 1), token
type embeddings and a LayerNorm on the embeddings, every token attending to its whole sequence.
This file maps the config and renames the checkpoint's tensors into OPT's names at load; a
`bert.` / `roberta.` prefix (a task model's) is dropped. A *ForSequenceClassification's head
(BERT's pooler + classifier, RoBERTa's classifier: tanh(dense([CLS])) then a projection) is read
into the port's classifier head; an embedding model's BertModel pooler, which no pooling reads,
is skipped."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import numpy as np

from jaxserve.models.opt import OPTArgs

# BERT name (after any `bert.` / `roberta.`) -> OPT name; \\1 is the layer index.
_RENAMES = [
    (r"embeddings\.word_embeddings\.weight", "model.decoder.embed_tokens.weight"),
    (r"embeddings\.position_embeddings\.weight", "model.decoder.embed_positions.weight"),
    (r"embeddings\.token_type_embeddings\.weight", "model.decoder.embed_types.weight"),
    (r"embeddings\.LayerNorm\.(weight|bias)", r"model.decoder.embed_norm.\1"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.(weight|bias)", r"model.decoder.layers.\1.self_attn.q_proj.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.(weight|bias)", r"model.decoder.layers.\1.self_attn.k_proj.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.(weight|bias)", r"model.decoder.layers.\1.self_attn.v_proj.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"model.decoder.layers.\1.self_attn.out_proj.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|bias)",
     r"model.decoder.layers.\1.self_attn_layer_norm.\2"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"model.decoder.layers.\1.fc1.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"model.decoder.layers.\1.fc2.\2"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)", r"model.decoder.layers.\1.final_layer_norm.\2"),
]  # fmt: skip
# a classifier's head: BERT's pooler and classifier, RoBERTa's classifier.dense and out_proj
_HEAD = [
    (r"pooler\.dense\.(weight|bias)", r"model.decoder.cls_dense.\1"),
    (r"classifier\.(weight|bias)", r"model.decoder.cls_out.\1"),
    (r"classifier\.dense\.(weight|bias)", r"model.decoder.cls_dense.\1"),
    (r"classifier\.out_proj\.(weight|bias)", r"model.decoder.cls_out.\1"),
]
_SKIPPED = re.compile(r"pooler\.dense\.(weight|bias)|embeddings\.position_ids")
_ROBERTA = ("roberta", "xlm-roberta")


def bert_args(hf: Mapping, max_model_len: int) -> OPTArgs:
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"BERT models with position_embedding_type={hf['position_embedding_type']!r} are not supported "
            "by jaxserve (absolute only)."
        )
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    roberta = hf.get("model_type") in _ROBERTA
    return OPTArgs(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        word_embed_proj_dim=hidden,
        num_positions=hf["max_position_embeddings"],
        position_offset=hf.get("pad_token_id", 1) + 1 if roberta else 0,
        pre_norm=False,
        final_norm=False,
        norm_affine=True,
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        bias=True,
        activation=hf.get("hidden_act", "gelu"),
        tie_word_embeddings=True,  # an encoder has no LM head here
        bidirectional=True,
        embed_norm=True,
        type_vocab_size=hf.get("type_vocab_size", 2),
        sep_token_id=hf.get("sep_token_id", 102 if not roberta else 2),
    ).check_len(max_model_len)


def encoder_max_len(hf: Mapping) -> int | None:
    """An encoder's longest input: RoBERTa's position table holds padding_idx + 1 rows before its
    first position; None for a model that is not one of these encoders."""
    if hf.get("model_type") in _ROBERTA:
        return hf["max_position_embeddings"] - hf.get("pad_token_id", 1) - 1
    return hf["max_position_embeddings"] if hf.get("model_type") in ("bert", "modernbert") else None


def bert_names(name: str, tensor: np.ndarray, args: OPTArgs) -> Iterator[tuple[str, np.ndarray]]:
    """One BERT checkpoint tensor -> its OPT name (nothing for the skipped ones)."""
    short = re.sub(r"^(bert|roberta)\.", "", name)
    if not args.num_labels and _SKIPPED.fullmatch(short):
        return
    for pattern, target in _RENAMES + (_HEAD if args.num_labels else []):
        if re.fullmatch(pattern, short):
            yield re.sub(pattern, target, short), tensor
            return
    yield name, tensor  # unknown: the loader names it
