"""The device side's contract (scheduler_output.StepRunner), checked the same way on the fake
runner the host-side tests use and on the real ModelRunner: what one proves about the engine
with the fake holds with the real one only as far as both answer alike.

Both take the same scheduled steps from a real Scheduler: two requests, one asking for
logprobs, then the next step planned before the first is collected (asynchronous scheduling,
whose rows are fed the token the device sampled and the host has not seen)."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import fake_engine
from tiny_models import engine_kwargs

from jaxserve import SamplingParams
from jaxserve.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.scheduler_output import PLACEHOLDER_TOKEN, ModelRunnerOutput, StepRunner


@pytest.fixture(params=["fake", "model"])
def engine(request, tiny_llama_gqa) -> LLMEngine:
    if request.param == "fake":
        return fake_engine(tiny_llama_gqa[0], async_scheduling=True)
    kwargs = engine_kwargs(max_num_seqs=4, num_gpu_blocks_override=32)
    return LLMEngine(
        EngineArgs(model=tiny_llama_gqa[0], async_scheduling=True, **kwargs).create_engine_config()
    )


def _check_output(out: ModelRunnerOutput, sched, vocab: int, logprob_rows: list[int]) -> None:
    sampled = [s.request_id for s in sched.seqs if s.sampling is not None]
    assert out.req_ids == tuple(sampled)
    assert out.sampled_token_ids.dtype == np.int32 and out.sampled_token_ids.shape == (len(sampled),)
    assert ((out.sampled_token_ids >= 0) & (out.sampled_token_ids < vocab)).all()
    assert out.logprobs.dtype == np.float32 and out.logprobs.shape == (len(sampled),)
    assert (out.logprobs <= 0).all()
    top = out.top_logprobs
    assert top is not None and top.ids.shape[0] == len(sampled)  # rows as req_ids
    for row in logprob_rows:  # the sampled token's own logprob and rank come with the top ones
        assert top.chosen_logprobs[row] == pytest.approx(out.logprobs[row], abs=1e-5)
        assert top.chosen_ranks[row] >= 1
        assert (np.diff(top.logprobs[row]) <= 1e-6).all()  # ranked, likeliest first


def test_fake_and_real_runners_answer_the_same_contract(engine):
    runner, scheduler = engine.runner, engine.scheduler
    assert isinstance(runner, StepRunner)
    assert runner.num_blocks == scheduler.block_manager.num_blocks
    assert runner.ready_token_budget is None or runner.ready_token_budget > 0
    assert not runner.kv_pool_lost
    vocab = runner.args.vocab_size
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, logprobs=2))
    engine.add_request("b", {"prompt_token_ids": [8, 9]}, SamplingParams(max_tokens=4))

    first = scheduler.schedule()
    handle = runner.dispatch(first)
    runner.wait_ready(handle)
    assert runner.is_ready(handle)
    second = scheduler.schedule()  # planned before the first is collected
    assert all(s.token_ids[-1] == PLACEHOLDER_TOKEN and s.feed_from_row >= 0 for s in second.seqs)
    second_handle = runner.dispatch(second)

    out = runner.collect(handle)
    _check_output(out, first, vocab, logprob_rows=[0])
    updated = scheduler.update(first, out)
    assert [r.output_token_ids for r in updated] == [[int(t)] for t in out.sampled_token_ids]

    out2 = runner.collect(second_handle)
    _check_output(out2, second, vocab, logprob_rows=[0])
    updated = scheduler.update(second, out2)
    assert [r.output_token_ids[1:] for r in updated] == [[int(t)] for t in out2.sampled_token_ids]

    runner.reset_kv_pool()
    assert not runner.kv_pool_lost
