"""get_tokenizer: one call for a .gguf file or a Hugging Face directory, one error type for neither."""

from __future__ import annotations

import pytest

from jaxserve.loader.gguf import load_gguf_tokenizer
from jaxserve.loader.tokenizer import get_tokenizer

TEXTS = ["hello world", "<|im_start|>user\nhello<|im_end|>", "héllo 日本"]


def test_gguf_path_dispatches_to_the_gguf_tokenizer(tiny_gguf):
    tokenizer = get_tokenizer(tiny_gguf.path)
    reference = load_gguf_tokenizer(tiny_gguf.path)
    assert tokenizer.is_fast
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text)


def test_hf_directory_round_trips_a_saved_tokenizer(tiny_gguf, tmp_path):
    original = load_gguf_tokenizer(tiny_gguf.path)
    original.save_pretrained(str(tmp_path))
    tokenizer = get_tokenizer(str(tmp_path))
    assert tokenizer.is_fast
    assert tokenizer.chat_template == original.chat_template
    for text in TEXTS:
        assert tokenizer.encode(text) == original.encode(text)


def test_directory_without_a_tokenizer_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match=str(tmp_path)):
        get_tokenizer(str(tmp_path))


@pytest.mark.parametrize("name", ["missing-dir", "missing.gguf"])
def test_missing_path_is_named(tmp_path, name):
    path = str(tmp_path / name)
    with pytest.raises(ValueError, match=name):
        get_tokenizer(path)


def test_gguf_tokenizer_is_cached_and_identical(default_gguf, tmp_path, monkeypatch):
    from jaxserve.loader.gguf import load_gguf_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fresh = load_gguf_tokenizer(default_gguf)
    entries = list((tmp_path / "jaxserve" / "tokenizers").iterdir())
    assert len(entries) == 1
    cached = load_gguf_tokenizer(default_gguf)
    text = "Hello world, café 日本 🙂 <|im_start|>user"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert cached.encode(text) == fresh.encode(text)
    assert cached.apply_chat_template(messages, tokenize=False) == fresh.apply_chat_template(
        messages, tokenize=False
    )
    assert (cached.eos_token_id, cached.bos_token_id) == (fresh.eos_token_id, fresh.bos_token_id)
