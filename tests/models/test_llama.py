"""Llama-family port against transformers on the same weights (float32): logits at every
prompt position, and greedy generation over a batch of mixed-length prompts."""

from __future__ import annotations

import pytest
from reference_checks import assert_greedy_batch_matches, assert_logits_match_at_every_position
from tiny_models import engine_kwargs

from jaxserve.args import EngineArgs


def test_logits_match_transformers_at_every_position(tiny_llama):
    assert_logits_match_at_every_position(*tiny_llama)


def test_greedy_batch_matches_transformers(tiny_llama):
    assert_greedy_batch_matches(*tiny_llama)


def test_unknown_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FancyNetForCausalLM"], "vocab_size": 8}')
    with pytest.raises(ValueError, match=r"FancyNetForCausalLM.*supported: .*LlamaForCausalLM"):
        EngineArgs(model=str(tmp_path), **engine_kwargs()).create_engine_config()
