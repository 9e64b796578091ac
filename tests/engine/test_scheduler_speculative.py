"""The scheduler with proposed tokens (speculative decoding), against the fake model: whatever is
proposed, right or wrong, every request gets the outputs it gets without proposals, the KV of
rejected proposals is written over (the fake reads each context back through the page table),
and pages, budgets and preemption stay sound."""

from __future__ import annotations

import random

import pytest
from fakes import context_token

from jaxserve.engine.request import RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.stats import SpecDecodingStats


class OracleProposer:
    """Proposes the fake model's own continuation, wrong from a random position on (or at once),
    so rows keep anything from none to all of their proposals."""

    needs_pages = False

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.finished: list[str] = []

    def propose(self, request_id, token_ids, num_prompt_tokens, k):
        context, out = list(token_ids), []
        right = self.rng.randint(0, k)
        for i in range(self.rng.randint(0, k)):
            token = context_token(context) if i < right else 3 + self.rng.randrange(40)
            out.append(token)
            context.append(token)
        return out

    def finish(self, request_id, token_ids, num_prompt_tokens):
        self.finished.append(request_id)


class PagedOracleProposer(OracleProposer):
    """The same proposals for all decoding rows at once, as a draft model makes them: each row's
    pages must already hold the positions a draft model writes (its tokens and the first k - 1
    of its k proposals)."""

    needs_pages = True

    def __init__(self, seed: int, block_size: int, k: int):
        super().__init__(seed)
        self.block_size, self.k, self.calls = block_size, k, 0

    def propose_many(self, rows):
        self.calls += 1
        out = {}
        for request_id, token_ids, pages, k in rows:
            assert 0 < k <= self.k and len(pages) * self.block_size >= len(token_ids) + k - 1
            out[request_id] = self.propose(request_id, token_ids, 0, self.k)  # (more than k: trimmed)
        return out


def _with_proposals(scheduler: Scheduler, k: int, seed: int = 0, paged: bool = False) -> OracleProposer:
    block_size = scheduler.block_manager.block_size
    proposer = PagedOracleProposer(seed, block_size, k) if paged else OracleProposer(seed)
    scheduler.proposer, scheduler.num_speculative_tokens = proposer, k
    scheduler.spec_stats = SpecDecodingStats()
    return proposer


def _workload(make_request):
    shared = list(range(2, 14))
    prompts = [shared + [20 + i] * (i % 5 + 1) if i % 2 else [30 + i] * (5 + 2 * i) for i in range(10)]
    return [make_request(p, max_tokens=9 + i % 7, stop_token_ids=[120 + i]) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("paged", [False, True], ids=["host", "on-pages"])
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("num_blocks", [200, 14])  # 14: preemption
def test_outputs_equal_without_proposals(
    make_scheduler, make_request, run, prefix_caching, num_blocks, paged
):
    reference = make_scheduler(num_blocks=200, enable_prefix_caching=prefix_caching)
    expected = _workload(make_request)
    for r in expected:
        reference.add_request(r)
    run(reference)

    sched = make_scheduler(
        num_blocks=num_blocks, enable_prefix_caching=prefix_caching, max_num_batched_tokens=24
    )
    proposer = _with_proposals(sched, k=4, paged=paged)
    reqs = _workload(make_request)
    for r in reqs:
        sched.add_request(r)
    steps = run(sched)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in expected]
    assert [r.status for r in reqs] == [r.status for r in expected]
    assert (sched.num_preemptions > 0) == (num_blocks < 100)
    stats = sched.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(s.num_drafts for step in steps for s in step.seqs) == stats.num_draft_tokens
    assert sorted(proposer.finished) == sorted(r.request_id for r in reqs)
    # fewer steps than tokens: rows kept several tokens
    assert len(steps) < sum(r.num_output_tokens for r in expected)
    if paged:  # one call a step for all rows
        assert 0 < proposer.calls <= len(steps)


def test_proposals_stop_at_max_tokens_and_respect_the_budget(make_scheduler, make_request, run):
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=6)
    _with_proposals(sched, k=8)
    reqs = [make_request(4, max_tokens=5, ignore_eos=True), make_request(4, max_tokens=3, ignore_eos=True)]
    for r in reqs:
        sched.add_request(r)
    steps = run(sched)
    for step in steps:
        for s in step.seqs:
            req = next(r for r in reqs if r.request_id == s.request_id)
            # a row never proposes past the request's last output
            assert s.start_pos + s.num_new - req.num_prompt_tokens <= req.sampling_params.max_tokens
    assert [r.num_output_tokens for r in reqs] == [5, 3]
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)


def test_no_proposals_for_rows_that_depend_on_each_token(make_scheduler, make_request, run):
    sched = make_scheduler(num_blocks=64)
    _with_proposals(sched, k=4)
    held = make_request(4, max_tokens=8, min_tokens=5)
    sched.add_request(held)
    steps = run(sched)
    proposed = [s.start_pos + 1 - held.num_prompt_tokens for step in steps for s in step.seqs if s.num_drafts]
    assert proposed and min(proposed) >= 5  # none while min_tokens holds eos back
