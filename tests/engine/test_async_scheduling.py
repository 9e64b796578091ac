"""The scheduler planning step N+1 before step N's tokens are back (asynchronous scheduling).

Driven by FakeModel (tests/fakes.py), which feeds a row's pending token from its own previous answer
as the device does, and checks every row's context through the page table: a pending token fed
to the wrong row, a page cached before its tokens are known, or a page freed while still needed
shows up as a corrupted context. Whatever the overlap, every request must end with the tokens,
finish reason and stop reason of the synchronous schedule.
"""

from __future__ import annotations

import random

import pytest
from fakes import EOS, context_token

from jaxserve.engine.request import RequestStatus
from jaxserve.scheduler_output import PLACEHOLDER_TOKEN


def eos_sometimes(req, context):
    token = context_token(context)
    return EOS if token % 11 == 0 else token


def workload(make_request, seed: int):
    rng = random.Random(seed)
    shared = [rng.randrange(2, 90) for _ in range(10)]
    reqs = []
    for _ in range(14):
        prompt = [rng.randrange(2, 90) for _ in range(rng.randrange(1, 14))]
        if rng.random() < 0.5:
            prompt = shared + prompt
        params = {}
        if rng.random() < 0.3:
            params["stop_token_ids"] = [rng.randrange(100, 150) for _ in range(3)]
        if rng.random() < 0.2:
            params["min_tokens"] = 1
        if rng.random() < 0.2:
            params["ignore_eos"] = True
        reqs.append((prompt, rng.randrange(2, 14), params))
    return [make_request(p, max_tokens=m, **kw) for p, m, kw in reqs]


CONFIGS = {
    "plain": {},
    "prefix-cache": {"enable_prefix_caching": True},
    "preempting": {"num_blocks": 14, "enable_prefix_caching": True},
    "chunked": {"max_num_batched_tokens": 8, "max_num_seqs": 3},
    "priority": {"num_blocks": 14, "policy": "priority"},
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlapped_steps_end_every_request_as_the_synchronous_ones(
    make_scheduler, make_request, fake_model, run, config, seed
):
    finished = {}
    for overlap in (False, True):
        sched = make_scheduler(**config)
        reqs = workload(make_request, seed)
        for r in reqs:
            sched.add_request(r)
        steps = run(sched, fake_model(sched, eos_sometimes), overlap=overlap)
        finished[overlap] = [(r.output_token_ids, r.status, r.stop_reason) for r in reqs]
        rows = [(s.request_id, s.sampling is not None) for out in steps for s in out.seqs]
        for r in reqs:
            sampled = sum(1 for rid, samples in rows if rid == r.request_id and samples)
            if r.status == RequestStatus.FINISHED_LENGTH or not overlap:
                assert sampled == r.num_output_tokens, r  # the length limit costs no extra row
            else:  # a stop seen one step late: one row too many, its token dropped
                assert r.num_output_tokens <= sampled <= r.num_output_tokens + 1, r
        fed = sum(1 for out in steps for s in out.seqs if s.feed_from_row >= 0)
        assert (fed > 0) == overlap
        if config.get("num_blocks") == 14:
            assert sched.num_preemptions > 0
    assert finished[True] == finished[False]
    assert len({tuple(out) for out, _, _ in finished[False]}) > 10  # the requests differ


def test_a_pending_token_is_fed_from_its_row_of_the_step_before(
    make_scheduler, make_request, fake_model, run
):
    sched = make_scheduler()
    a, b = make_request(5, max_tokens=4), make_request(3, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    steps = run(sched, fake_model(sched), overlap=True)
    assert [s.request_id for s in steps[0].seqs] == [a.request_id, b.request_id]
    for before, after in zip(steps, steps[1:]):
        row_before = {s.request_id: row for row, s in enumerate(before.seqs)}
        for s in after.seqs:
            assert s.num_new == 1 and s.token_ids == (PLACEHOLDER_TOKEN,)
            assert s.feed_from_row == row_before[s.request_id]
    assert len(steps) == 4  # each step planned before the last one's token was back


def test_a_request_preempted_with_a_token_in_flight_keeps_it(make_scheduler, make_request, fake_model, run):
    # three pages of 4 tokens; each request grows to two: one is preempted
    sched = make_scheduler(num_blocks=4, block_size=4)
    first, second = make_request(3, max_tokens=6), make_request(3, max_tokens=6)
    sched.add_request(first)
    sched.add_request(second)
    run(sched, fake_model(sched), overlap=True)
    assert sched.num_preemptions > 0
    plain = make_scheduler(num_blocks=64, block_size=4)
    again = [make_request(r.prompt_token_ids, max_tokens=6) for r in (first, second)]
    for r in again:
        plain.add_request(r)
    run(plain)
    assert [r.output_token_ids for r in again] == [r.output_token_ids for r in (first, second)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_pages_ending_in_a_pending_token_are_cached_once_it_is_back(
    make_scheduler, make_request, fake_model, run, overlap
):
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    model = fake_model(sched)  # one KV store across runs: cache hits read it
    first = make_request(6, max_tokens=10)  # page 2 (tokens 8..11) ends on a generated token
    sched.add_request(first)
    run(sched, model, overlap=overlap)
    follow = make_request(first.all_token_ids + [70, 71], max_tokens=2)
    sched.add_request(follow)
    run(sched, model, overlap=overlap)
    assert follow.num_cached_tokens == 12  # 15 KV tokens were written: 3 full pages
