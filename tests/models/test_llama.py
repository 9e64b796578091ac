"""Llama-family port against transformers on the same weights (float32): logits at every
prompt position, and greedy generation over a batch of mixed-length prompts."""

from __future__ import annotations

import numpy as np
import pytest
from reference_checks import assert_greedy_generation_matches, prompt_logits, teacher_forced_logits
from tiny_models import engine_kwargs

from jaxserve import LLM
from jaxserve.args import EngineArgs
from jaxserve.runner.model_runner import ModelRunner


def test_logits_match_transformers_at_every_position(tiny_llama):
    path, torch_model = tiny_llama
    runner = ModelRunner(EngineArgs(model=path, **engine_kwargs()).create_engine_config())
    rng = np.random.default_rng(0)
    for n in (1, 7, 8, 9, 45):
        ids = rng.integers(3, 500, size=n).tolist()
        ours = prompt_logits(runner, ids)
        ref = teacher_forced_logits(torch_model, ids)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_greedy_batch_matches_transformers(tiny_llama):
    path, torch_model = tiny_llama
    llm = LLM(path, **engine_kwargs())
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (3, 17, 40, 9, 64, 1)]
    assert_greedy_generation_matches(llm, torch_model, prompts)


def test_unknown_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FancyNetForCausalLM"], "vocab_size": 8}')
    with pytest.raises(ValueError, match=r"FancyNetForCausalLM.*supported: LlamaForCausalLM"):
        EngineArgs(model=str(tmp_path), **engine_kwargs()).create_engine_config()
