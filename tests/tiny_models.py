"""Tiny random Hugging Face checkpoints made on the spot with transformers + torch (the
reference), and engine arguments sized for a 2-core CPU."""

from __future__ import annotations

import os
import tempfile

TINY_LLAMA = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

LLAMA_VARIANTS = {
    "gqa": {},
    "tied": {"tie_word_embeddings": True, "num_key_value_heads": 4},
    "llama3_rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        "rope_theta": 500000.0,
        "num_key_value_heads": 1,
    },
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "JAX compiles numerical programs with XLA for TPUs, GPUs and CPUs.",
    "Once upon a time there was a tiny language model that served requests.",
    "café naïve 日本語 emoji 🙂 numbers 0123456789",
]


def make_tokenizer(vocab_size: int):
    """A small byte-level BPE tokenizer trained on the spot (no hub access)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    return fast


def make_llama_checkpoint(path, variant: str = "gqa", dtype: str = "float32", seed: int = 0):
    """Save a tiny random LlamaForCausalLM with its tokenizer; return the torch model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **LLAMA_VARIANTS[variant]})
    model = LlamaForCausalLM(config).eval()
    # Larger-than-default weights give logits with real spread, so greedy ties are rare.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    return model


# One persistent compilation cache for all tests: engines built on the same tiny model with
# the same shapes compile once per run instead of once per test.
TEST_XLA_CACHE = os.path.join(tempfile.gettempdir(), "jaxserve-test-xla-cache")


def engine_kwargs(**overrides):
    """Engine arguments for tiny models on this CPU: few buckets, a small pool."""
    kw = dict(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_gpu_blocks_override=64,
        block_size=8,
        enforce_eager=True,
        compilation_config={"cache_dir": TEST_XLA_CACHE},
        use_tqdm_on_load=False,
    )
    kw.update(overrides)
    return kw
