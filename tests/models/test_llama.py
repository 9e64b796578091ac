"""Llama-family port against transformers on the same weights (float32): logits at every
prompt position, and greedy generation over a batch of mixed-length prompts."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from reference_checks import check_greedy, teacher_forced_logits
from tiny_models import engine_kwargs

from jaxserve import LLM, SamplingParams
from jaxserve.args import EngineArgs
from jaxserve.runner import batch as batch_lib
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.scheduler_output import SamplingRow, ScheduledSeq, SchedulerOutput

GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0)


def prompt_logits(runner: ModelRunner, token_ids: list[int]) -> np.ndarray:
    """Run the model over one prompt through the runner's own batch layout and paged KV
    pool, asking for logits at every position."""
    n = len(token_ids)
    pages = tuple(range(1, 1 + -(-n // runner.page_size)))
    sched = SchedulerOutput((ScheduledSeq("r", tuple(token_ids), 0, pages, GREEDY),))
    inputs = batch_lib.prepare(sched, n, 1, runner.page_size, runner.pages_per_seq, runner.pad_slot)
    inputs = batch_lib.BatchInputs(
        inputs.input_ids, inputs.positions, inputs.meta, np.arange(n, dtype=np.int32), inputs.sampling
    )
    inputs = jax.device_put(inputs)
    model = nnx.merge(runner.graphdef, runner.state)
    logits, _ = model(inputs.input_ids, inputs.positions, runner.kv_pool, inputs.meta, inputs.logits_indices)
    return np.asarray(logits)


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
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
        use_tqdm=False,
    )
    compared = total = 0
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert len(out.outputs[0].token_ids) == 32 and out.outputs[0].finish_reason == "length"
        c, t = check_greedy(torch_model, prompt, out.outputs[0].token_ids)
        compared, total = compared + c, total + t
    assert compared >= 0.9 * total


def test_unknown_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FancyNetForCausalLM"], "vocab_size": 8}')
    with pytest.raises(ValueError, match=r"FancyNetForCausalLM.*supported: LlamaForCausalLM"):
        EngineArgs(model=str(tmp_path), **engine_kwargs()).create_engine_config()
