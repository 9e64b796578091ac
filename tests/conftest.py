"""Shared fixtures: tiny random checkpoints of each supported variant (see tiny_models.py)."""

from __future__ import annotations

import os

import pytest
from tiny_models import DENSE_FAMILIES, LLAMA_VARIANTS, make_family_checkpoint, make_llama_checkpoint

# Tests never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", params=sorted(LLAMA_VARIANTS))
def tiny_llama(request, tmp_path_factory):
    """(checkpoint dir, torch reference model) for each Llama variant."""
    path = tmp_path_factory.mktemp(f"llama-{request.param}")
    model = make_llama_checkpoint(path, request.param)
    return str(path), model


@pytest.fixture(scope="session")
def tiny_llama_gqa(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-gqa-engine")
    model = make_llama_checkpoint(path, "gqa")
    return str(path), model


@pytest.fixture(scope="session", params=sorted(DENSE_FAMILIES))
def tiny_family(request, tmp_path_factory):
    """(checkpoint dir, torch reference model) for each non-Llama dense family."""
    path = tmp_path_factory.mktemp(request.param)
    return str(path), make_family_checkpoint(path, request.param)
