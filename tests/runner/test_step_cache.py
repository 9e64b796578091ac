"""Compiled steps in a StepCache (runner/step_cache.py): runners handed one cache compile a step
once between them, runners with caches of their own compile it each, and the cache keeps the
most recently used steps within its bound."""

from __future__ import annotations

import numpy as np
from reference_checks import compilations
from tiny_models import engine_kwargs

from jaxserve.args import EngineArgs
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step_cache import StepCache
from jaxserve.scheduler_output import SamplingRow, ScheduledSeq, SchedulerOutput

GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, output_start=0)
PROMPT = SchedulerOutput((ScheduledSeq("r", (5, 6, 7, 8), 0, (1,), GREEDY),))


def test_the_least_recently_used_step_goes_past_the_bound():
    cache = StepCache(max_steps=2)
    built = []

    def get(key):
        return cache.get_or_build(key, lambda: built.append(key) or f"step {key}")

    assert [get("a"), get("b"), get("a")] == ["step a", "step b", "step a"]
    get("c")  # three steps held at most two: b, the least recently used, goes
    assert len(cache) == 2
    get("a")
    get("b")
    assert built == ["a", "b", "c", "b"]
    assert (cache.hits, cache.misses) == (2, 4)


def test_runners_sharing_a_cache_compile_a_step_once_and_private_ones_each(tiny_llama_gqa):
    config = EngineArgs(model=tiny_llama_gqa[0], **engine_kwargs()).create_engine_config()

    def tokens(runner: ModelRunner) -> np.ndarray:
        return runner.execute(PROMPT).sampled_token_ids

    shared = StepCache()
    first = ModelRunner(config, step_cache=shared)
    want = tokens(first)
    assert (shared.misses, shared.hits) == (1, 0)
    second = ModelRunner(config, step_cache=shared)
    with compilations() as compiles:
        np.testing.assert_array_equal(tokens(second), want)
    assert compiles == []  # the second runner compiled nothing
    assert (shared.misses, shared.hits) == (1, 1)

    apart = [ModelRunner(config), ModelRunner(config)]  # each makes a cache of its own
    assert apart[0].step_cache is not apart[1].step_cache
    for runner in apart:
        np.testing.assert_array_equal(tokens(runner), want)
        assert (runner.step_cache.misses, runner.step_cache.hits) == (1, 0)
