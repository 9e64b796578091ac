"""Fixtures for the loader tests: tiny checkpoints written on the spot."""

from __future__ import annotations

import os

import pytest
from tiny_checkpoints import TinyGguf, write_tiny_gguf


@pytest.fixture(scope="session", params=[True, False], ids=["tied", "untied"])
def tiny_gguf(request, tmp_path_factory) -> TinyGguf:
    directory = tmp_path_factory.mktemp("gguf")
    return write_tiny_gguf(os.path.join(directory, "tiny.gguf"), tied=request.param)


@pytest.fixture(scope="session")
def tiny_hf_model():
    """A random 2-layer LlamaForCausalLM (torch) to save in every checkpoint layout."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).eval()
