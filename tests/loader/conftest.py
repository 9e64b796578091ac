"""Fixtures for the loader tests: tiny checkpoints written on the spot."""

from __future__ import annotations

import os

import pytest
from tiny_checkpoints import TinyGguf, write_tiny_gguf
from tiny_models import TINY_LLAMA


@pytest.fixture(scope="session", params=[True, False], ids=["tied", "untied"])
def tiny_gguf(request, tmp_path_factory) -> TinyGguf:
    directory = tmp_path_factory.mktemp("gguf")
    return write_tiny_gguf(os.path.join(directory, "tiny.gguf"), tied=request.param)


@pytest.fixture(scope="session")
def tiny_hf_model():
    """A random 2-layer LlamaForCausalLM (torch) to save in every checkpoint layout: the tiny
    Llama, with a smaller vocabulary, MLP and context so that its files stay small."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = {"vocab_size": 128, "intermediate_size": 96, "max_position_embeddings": 128}
    config = transformers.LlamaConfig(**{**TINY_LLAMA, **small, "tie_word_embeddings": False})
    return transformers.LlamaForCausalLM(config).eval()
