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


@pytest.mark.parametrize(
    "rope, max_model_len, lengths",
    [
        # linear: positions divided by the factor, whatever the length
        ({"rope_type": "linear", "factor": 4.0}, 256, (1, 9, 45)),
        # dynamic NTK: the base grows with the length past the trained 32 positions; jaxserve
        # fixes it for the served length (as vLLM does), transformers for the sequence in
        # hand, so they agree on a prompt exactly as long as the served length
        ({"rope_type": "dynamic", "factor": 2.0}, 48, (48,)),
    ],
    ids=["linear", "dynamic"],
)
def test_rope_scaling_matches_transformers(tmp_path, rope, max_model_len, lengths):
    from tiny_models import make_checkpoint

    overrides = {"rope_parameters": {**rope, "rope_theta": 10000.0}, "max_position_embeddings": 32}
    if rope["rope_type"] == "linear":
        overrides["max_position_embeddings"] = 64  # 4 x 64 = 256 served positions
    model = make_checkpoint(tmp_path, "LlamaConfig", "LlamaForCausalLM", overrides, "float32", 0)
    assert_logits_match_at_every_position(str(tmp_path), model, lengths=lengths, max_model_len=max_model_len)
