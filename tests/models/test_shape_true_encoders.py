"""Encoders at their published checkpoints' shapes, against transformers on the same random
weights (no BERT-class weights come from the package index): bge-small-en-v1.5 (BERT, 384 wide,
12 layers), gte-modernbert-base (ModernBERT, 768 wide, 22 layers, a global layer every third)
and bge-m3 (XLM-RoBERTa, 1024 wide, a 250002-token vocabulary; 2 of its 24 layers, since each
layer runs the same program and depth only repeats it). Each served as its sentence-transformers
folder pools it (CLS, normalized), for single texts and BERT's pairs; cosine >= 0.999 is the
issue's bar, the check is tighter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference_checks import assert_vectors_close
from tiny_models import engine_kwargs

from jaxserve import LLM

SHAPES = {
    "bge-small-en-v1.5": (
        "BertConfig",
        "BertModel",
        dict(vocab_size=30522, hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
             intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0),
    ),
    "gte-modernbert-base": (
        "ModernBertConfig",
        "ModernBertModel",
        dict(vocab_size=50368, hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
             intermediate_size=1152, max_position_embeddings=8192, global_attn_every_n_layers=3,
             local_attention=128, global_rope_theta=160000.0, local_rope_theta=10000.0,
             pad_token_id=50283, cls_token_id=50281, sep_token_id=50282, bos_token_id=50281,
             eos_token_id=50282),
    ),
    "bge-m3": (
        "XLMRobertaConfig",
        "XLMRobertaModel",
        dict(vocab_size=250002, hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
             intermediate_size=4096, max_position_embeddings=8194, type_vocab_size=1, pad_token_id=1,
             bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5),
    ),
}  # fmt: skip
# (first token, separator) of each family's prompts
SPECIAL = {"bge-small-en-v1.5": (101, 102), "gte-modernbert-base": (50281, 50282), "bge-m3": (0, 2)}


def make(path, name: str):
    import transformers

    config_cls, model_cls, shape = SHAPES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**shape)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # weights with the spread of trained ones, so a misplaced norm shows
        for p in model.parameters():
            p.normal_(0.0, 0.05) if p.ndim == 2 else p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("name", list(SHAPES))
def test_published_encoder_shapes_match_transformers(tmp_path, name):
    model = make(tmp_path, name)
    first, sep = SPECIAL[name]
    rng = np.random.default_rng(0)
    words = lambda n: rng.integers(1000, 20000, n).tolist()  # noqa: E731
    prompts = [[first, *words(40), sep], [first, *words(7), sep]]
    types = [None, None]
    if name != "gte-modernbert-base":  # a pair read together: [CLS] a [SEP] b [SEP]
        a, b = words(12), words(20)
        prompts.append([first, *a, sep, *b, sep])
        types.append([0] * (len(a) + 2) + [1] * (len(b) + 1) if name.startswith("bge-small") else None)
    llm = LLM(
        str(tmp_path), skip_tokenizer_init=True, **engine_kwargs(max_num_batched_tokens=128, max_model_len=96)
    )
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, kinds, out in zip(prompts, types, outs):
        kw = {} if kinds is None else {"token_type_ids": torch.tensor([kinds])}
        with torch.no_grad():
            cls = model(torch.tensor([prompt]), **kw).last_hidden_state[0, 0].double().numpy()
        assert_vectors_close(out.outputs.embedding, cls / np.linalg.norm(cls))
