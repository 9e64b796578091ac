"""Start-up compiles two buckets and serves; the rest compile in the background, and until they
are ready every step fits a compiled bucket (the scheduler's budget follows the ready ones), so no
request waits on or triggers a compile and the tokens are the ones a fully compiled engine gives."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from reference_checks import compilations
from tiny_models import engine_kwargs

from jaxserve import LLM, SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.runner import bucket_compiles
from jaxserve.runner.bucketing import FIRST_PREFILL_TOKENS

BUDGET = 256  # token buckets 1, 2, 4, ..., 256 on CPU


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(3, 500, size=n).tolist() for n in (200, 5, 17, 40)]


@pytest.fixture
def pause_background(monkeypatch):
    """pause_background() -> an Event: runners made after the call start their background
    compile only once it is set."""
    release = threading.Event()
    original = bucket_compiles.BucketCompiles.compile_rest

    def compile_rest(self, *args):
        release.wait(timeout=300)
        original(self, *args)

    def pause() -> threading.Event:
        monkeypatch.setattr(bucket_compiles.BucketCompiles, "compile_rest", compile_rest)
        return release

    return pause


def test_steps_fit_the_ready_buckets_until_the_rest_compile(
    tiny_llama_gqa, prompts, pause_background, step_cache
):
    kwargs = engine_kwargs(enforce_eager=False, max_num_batched_tokens=BUDGET, max_num_seqs=4)
    kwargs["compilation_config"] = {"cache_dir": ""}
    reference = LLM(tiny_llama_gqa[0], **kwargs)  # waits for every bucket
    long_prompt, batch = prompts[0], prompts  # the first is longer than the ready prefill bucket
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    release = pause_background()
    built = step_cache.misses
    engine = LLMEngine(reference.llm_engine.config)
    runner = engine.runner
    # the engines share the tests' StepCache (conftest.py): the second one's start-up built nothing
    assert runner.step_cache is step_cache and step_cache.misses == built
    first, rest = runner.buckets.startup_order()
    assert first == [1, FIRST_PREFILL_TOKENS] and runner.ready_token_budget == FIRST_PREFILL_TOKENS
    assert runner.num_compiled == len(first)

    steps = []
    original_dispatch = runner.dispatch

    def dispatch(sched, fill_bitmask=None):
        steps.append(sched.num_tokens)
        return original_dispatch(sched, fill_bitmask)

    runner.dispatch = dispatch
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    outputs = {}
    with compilations() as compiles:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
    assert compiles == []  # the engine never compiled; the paused background did not either
    assert runner.num_compiled == len(first)  # and never reached for a bucket that was not ready
    assert max(steps) <= FIRST_PREFILL_TOKENS < len(long_prompt)  # the long prompt went in chunks
    expected = reference.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [outputs[str(i)] for i in range(len(batch))] == [list(o.outputs[0].token_ids) for o in expected]

    release.set()
    runner.wait_compiled()
    assert runner.ready_token_budget == BUDGET
    assert runner.num_compiled == len(runner.buckets.all())


def test_stopping_the_background_compile_leaves_the_ready_buckets(tiny_llama_gqa, pause_background):
    kwargs = engine_kwargs(enforce_eager=False, max_num_batched_tokens=BUDGET, max_num_seqs=4)
    kwargs["compilation_config"] = {"cache_dir": ""}
    from jaxserve.args import EngineArgs

    release = pause_background()
    engine = LLMEngine(EngineArgs(model=tiny_llama_gqa[0], **kwargs).create_engine_config())
    engine.runner.compiles.stop(wait=False)  # before the thread starts its first bucket
    release.set()
    engine.runner.stop_compiling()
    assert engine.runner.ready_token_budget == FIRST_PREFILL_TOKENS
    assert engine.runner.num_compiled == 2
