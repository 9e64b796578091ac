"""The real engine (input checks, scheduler, detokenizer, outputs) driven by a fake runner.

LLMEngine takes its device side as an argument; a runner that answers instantly and
predictably makes the host-side logic testable on its own: stop strings finish through the
Scheduler (which frees the pages), n/best_of choose by cumulative logprob, a failing step fails
only its own requests, an abort frees everything. No JAX step is compiled here.
"""

from __future__ import annotations

import asyncio

import pytest
from fakes import fake_engine

from jaxserve import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine


@pytest.fixture(params=[True, False], ids=["async", "sync"])
def engine(tiny_llama_gqa, request):
    return fake_engine(tiny_llama_gqa[0], async_scheduling=request.param)


def _run(engine: LLMEngine, max_steps: int = 200) -> dict[str, object]:
    """Step until idle; the last output of each request."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            final[out.request_id] = out
    raise AssertionError("the engine did not finish")


def _all_pages_free(engine: LLMEngine) -> bool:
    bm = engine.scheduler.block_manager
    return bm.num_free_blocks == bm.num_usable_blocks and not engine.scheduler.has_unfinished_requests()


def test_tokens_flow_from_the_runner_to_the_outputs(engine):
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": [40] * 20}, SamplingParams(max_tokens=3, ignore_eos=True))
    final = _run(engine)
    assert final["a"].outputs[0].token_ids == [8, 9, 10, 11, 12, 13]
    assert final["b"].outputs[0].token_ids == [41, 42, 43]
    assert {o.outputs[0].finish_reason for o in final.values()} == {"length"}
    assert final["a"].outputs[0].text == engine.tokenizer.decode([8, 9, 10, 11, 12, 13])
    assert _all_pages_free(engine)
    assert engine.runner.steps[0].num_tokens == 23  # both prompts prefilled in the first step


@pytest.mark.parametrize("cut", [3, 6], ids=["mid-output", "on-the-last-token"])
def test_a_stop_string_finishes_through_the_scheduler(engine, cut):
    """A stop string completed by the token that also reaches max_tokens is a stop too."""
    tok = engine.tokenizer
    # a prompt whose fake continuation is six plain, distinct words of the vocabulary
    start = next(
        t
        for t in range(300, engine.runner.args.vocab_size - 8)
        if all(tok.decode([t + i]).strip().isalpha() for i in range(1, 7))
        and len({tok.decode([t + i]).strip() for i in range(1, 7)}) == 6
    )
    prompt = {"prompt_token_ids": [start - 1, start]}
    engine.add_request("plain", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    tokens = _run(engine)["plain"].outputs[0].token_ids
    stop = engine.tokenizer.decode(tokens[cut - 1 : cut])
    before = engine.tokenizer.decode(tokens[: cut - 1])
    assert stop.strip() and stop not in before  # the cut token is the first to complete it
    engine.add_request("stopped", prompt, SamplingParams(max_tokens=6, ignore_eos=True, stop=[stop]))
    out = _run(engine)["stopped"].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == tokens[:cut]
    assert out.text == before
    assert _all_pages_free(engine)


def test_best_of_reports_the_n_samples_of_highest_cumulative_logprob_at_the_end(engine):
    params = SamplingParams(n=2, best_of=3, max_tokens=4, ignore_eos=True, seed=10, logprobs=0)
    engine.add_request("r", {"prompt_token_ids": [3, 4, 5]}, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert [o.finished for o in seen] == [True]  # nothing before the best are known
    outs = seen[0].outputs
    # children seeded 10, 11, 12: per-token logprobs -0.1, -0.2, -0.3
    assert [o.cumulative_logprob for o in outs] == pytest.approx([-0.4, -0.8])
    assert [o.index for o in outs] == [0, 1]
    assert _all_pages_free(engine)


def test_a_failed_step_fails_only_its_requests(engine):
    for i in range(6):  # four run at once (max_num_seqs), two wait
        engine.add_request(
            f"r{i}", {"prompt_token_ids": [10 + i, 11]}, SamplingParams(max_tokens=3, ignore_eos=True)
        )
    engine.runner.fail_next = 1
    failed = engine.step()
    assert sorted(o.request_id for o in failed) == ["r0", "r1", "r2", "r3"]
    assert all(o.finished and o.error and o.outputs[0].finish_reason == "error" for o in failed)
    final = _run(engine)
    assert sorted(final) == ["r4", "r5"]
    assert all(
        o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 3 for o in final.values()
    )
    assert _all_pages_free(engine)


def test_an_abort_frees_the_request_and_is_counted_with_the_next_step(engine):
    engine.add_request("kept", {"prompt_token_ids": [7, 8]}, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request(
        "dropped", {"prompt_token_ids": [9, 10]}, SamplingParams(max_tokens=50, ignore_eos=True)
    )
    engine.step()
    engine.step()  # asynchronous: a step of both is in flight
    bm = engine.scheduler.block_manager
    held = len(bm.block_ids("dropped"))
    assert held > 0
    engine.abort_request("dropped")
    assert bm.block_ids("dropped") == []
    assert bm.num_free_blocks == bm.num_usable_blocks - len(bm.block_ids("kept"))
    engine.step()  # the dropped request's row in flight is discarded, not reported
    assert [f.finish_reason for f in engine.iteration_stats.finished] == ["abort"]
    assert "dropped" not in _run(engine)
    assert _all_pages_free(engine)


def test_bad_requests_are_refused_before_anything_is_queued(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(
        ValueError, match="maximum context length is 256 tokens. However, your request has 10000 input tokens"
    ):
        engine.add_request("y", {"prompt_token_ids": [1] * 10_000}, SamplingParams())
    assert not engine.has_unfinished_requests() and engine.runner.steps == []


def test_each_output_kind_reports_what_it_promises(engine):
    """FINAL_ONLY (the offline LLM's, and a non-streamed answer's): no output is built before the
    last step; CUMULATIVE: every step, all tokens so far; DELTA (a stream's): every step, only the
    new token, text and logprobs, which add up to the cumulative output (prompt logprobs once)."""
    from jaxserve.sampling_params import RequestOutputKind as Kind

    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    for kind in Kind:
        engine.add_request(kind.name, {"prompt_token_ids": [5, 6]}, params.clone(output_kind=kind))
    seen = {kind.name: [] for kind in Kind}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    sizes = {k: [len(o.outputs[0].token_ids) for o in outs] for k, outs in seen.items()}
    assert sizes == {"FINAL_ONLY": [5], "CUMULATIVE": [1, 2, 3, 4, 5], "DELTA": [1, 1, 1, 1, 1]}
    whole, deltas = seen["CUMULATIVE"][-1], seen["DELTA"]
    assert sum((o.outputs[0].token_ids for o in deltas), []) == whole.outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in deltas) == whole.outputs[0].text
    chosen = [next(iter(d)) for o in deltas for d in o.outputs[0].logprobs]  # (values vary by batch row)
    assert chosen == [next(iter(d)) for d in whole.outputs[0].logprobs] == whole.outputs[0].token_ids
    assert [o.prompt_logprobs is not None for o in deltas] == [True, False, False, False, False]
    assert [d and list(d) for d in deltas[0].prompt_logprobs] == [
        d and list(d) for d in whole.prompt_logprobs
    ]
    assert [o.outputs[0].finish_reason for o in deltas] == [None] * 4 + ["length"]


async def test_an_id_still_live_on_the_engine_fails_only_its_new_request(tiny_llama_gqa):
    """The server's table of streams is the first check of a request id; should the engine's
    thread still hold a request of that id, the new one fails alone and the engine goes on."""
    from jaxserve.engine.async_engine import AsyncLLMEngine

    engine = fake_engine(tiny_llama_gqa[0], async_scheduling=True)
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, long)  # not through the server
    server = AsyncLLMEngine(engine)

    async def same_id():
        async for _ in server.generate({"prompt_token_ids": [8]}, SamplingParams(max_tokens=2), "x"):
            pass

    second = asyncio.create_task(same_id())
    await asyncio.sleep(0)  # queued before the thread starts: its first turn reads it, "x" not yet run
    server.start()
    try:
        with pytest.raises(ValueError, match="already in use"):
            await second
        outputs = [
            o async for o in server.generate({"prompt_token_ids": [8]}, SamplingParams(max_tokens=2), "y")
        ]
        assert outputs[-1].finished and list(outputs[-1].outputs[0].token_ids) == [9, 10]
        assert server.dead_error is None
    finally:
        server.shutdown()


async def test_deltas_a_reader_has_not_taken_are_merged_into_one_output(tiny_llama_gqa):
    """A stream's reader that falls behind gets the deltas that came meanwhile as one output
    (text, tokens and logprobs appended in order), never a lost or repeated token."""
    from jaxserve.engine.async_engine import AsyncLLMEngine
    from jaxserve.sampling_params import RequestOutputKind

    engine = fake_engine(tiny_llama_gqa[0])
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)
    engine.add_request("whole", {"prompt_token_ids": [5, 6, 7]}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    whole = outputs[-1].outputs[0]

    server = AsyncLLMEngine(engine)
    server.start()
    try:
        stream = server.generate(
            {"prompt_token_ids": [5, 6, 7]}, params.clone(output_kind=RequestOutputKind.DELTA), "d"
        )
        first = await anext(stream)
        while engine.has_unfinished_requests():  # the engine runs on while nobody reads
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)  # its last outputs reach the stream on this loop
        rest = [out async for out in stream]
    finally:
        server.shutdown()
    outs = [first, *rest]  # what came before the first read is merged too
    assert (
        len(outs) <= 2 and outs[-1].finished and [o.finished for o in outs[:-1]] == [False] * (len(outs) - 1)
    )
    pieces = [o.outputs[0] for o in outs]
    assert sum((p.token_ids for p in pieces), []) == whole.token_ids
    assert "".join(p.text for p in pieces) == whole.text
    assert [next(iter(d)) for p in pieces for d in p.logprobs] == whole.token_ids
