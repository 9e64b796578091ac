import numpy as np
import pytest

from jaxserve.engine.request import RequestStatus
from jaxserve.scheduler_output import ModelRunnerOutput

EOS = 1  # the eos_token_id make_request gives every request


def outputs_of(requests):
    return {r.request_id: list(r.output_token_ids) for r in requests}


def rows_by_request(steps):
    """request id -> [(step index, start_pos, num_new, sampled?)]"""
    rows = {}
    for i, out in enumerate(steps):
        for seq in out.seqs:
            rows.setdefault(seq.request_id, []).append(
                (i, seq.start_pos, seq.num_new, seq.sampling is not None)
            )
    return rows


def test_mixed_workload_respects_budget_and_finishes(make_scheduler, make_request, run):
    sched = make_scheduler(max_num_batched_tokens=32, max_num_seqs=5)
    rng = np.random.default_rng(0)
    reqs = [make_request(int(rng.integers(1, 70)), max_tokens=int(rng.integers(1, 12))) for _ in range(20)]
    for r in reqs:
        sched.add_request(r)
    steps = run(sched)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == r.max_tokens
        assert r.cumulative_logprob == pytest.approx(-0.5 * r.max_tokens)
        assert r.first_token_time is not None
    assert max(out.num_tokens for out in steps) == 32
    assert sched.num_running == sched.num_waiting == 0 and sched.requests == {}


def test_chunked_prefill_runs_alongside_decodes(make_scheduler, make_request, run):
    sched = make_scheduler(max_num_batched_tokens=16)
    short = make_request(4, max_tokens=12)
    long = make_request(50, max_tokens=2)
    sched.add_request(short)
    sched.add_request(long)
    rows = rows_by_request(run(sched))

    # Step 0: short's whole prompt and the first 12-token chunk of long.
    assert rows["req-0"][0] == (0, 0, 4, True)
    chunks = rows["req-1"]
    assert [(start, n) for _, start, n, _ in chunks[:4]] == [(0, 12), (12, 15), (27, 15), (42, 8)]
    assert [sampled for *_, sampled in chunks[:4]] == [False, False, False, True]
    # While long prefills, short decodes one token per step in the same steps.
    for step, *_ in chunks[1:4]:
        assert (step, 1) in {(s, n) for s, _, n, _ in rows["req-0"]}


def test_long_prefill_token_threshold_caps_chunks(make_scheduler, make_request, run):
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=10)
    req = make_request(35, max_tokens=1)
    sched.add_request(req)
    chunks = rows_by_request(run(sched))["req-0"]
    assert [n for _, _, n, _ in chunks] == [10, 10, 10, 5]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step(make_scheduler, make_request, run):
    sched = make_scheduler(max_num_batched_tokens=20, enable_chunked_prefill=False, max_model_len=20)
    first = make_request(5, max_tokens=6)
    big = make_request(16, max_tokens=3)
    sched.add_request(first)
    sched.add_request(big)
    steps = run(sched)
    rows = rows_by_request(steps)
    # Step 0 holds first's prompt (5) and cannot hold big's 16; big starts whole later.
    assert rows["req-1"][0][1:] == (0, 16, True)
    assert rows["req-1"][0][0] > 0
    assert all(out.num_tokens <= 20 for out in steps)
    assert first.num_output_tokens == 6 and big.num_output_tokens == 3


def test_unschedulable_requests_are_refused(make_scheduler, make_request):
    sched = make_scheduler(num_blocks=5, block_size=4)  # 16 tokens of KV
    with pytest.raises(ValueError, match="KV cache"):
        sched.add_request(make_request(10, max_tokens=8))
    sched.add_request(make_request(10, max_tokens=7))  # 16 tokens of KV: fits
    sched = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="chunked prefill"):
        sched.add_request(make_request(17, max_tokens=1))
    sched.add_request(req := make_request(8, max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request(4, request_id=req.request_id))


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_gives_the_same_outputs(make_scheduler, make_request, run, prefix_caching, policy):
    def workload():
        shared = list(range(2, 14))  # half the requests share 3 pages of prompt
        prompts = [shared + [20 + i] * (i % 5 + 1) if i % 2 else [30 + i] * (5 + 2 * i) for i in range(12)]
        return [make_request(p, max_tokens=10 + i % 7, priority=i % 3) for i, p in enumerate(prompts)]

    big = make_scheduler(num_blocks=200, enable_prefix_caching=prefix_caching, policy=policy)
    reference = workload()
    for r in reference:
        big.add_request(r)
    run(big)
    assert big.num_preemptions == 0

    tiny = make_scheduler(num_blocks=12, enable_prefix_caching=prefix_caching, policy=policy)  # 44 tokens
    reqs = workload()
    for r in reqs:
        tiny.add_request(r)
    run(tiny)
    assert tiny.num_preemptions > 0
    assert sum(r.num_preemptions for r in reqs) == tiny.num_preemptions
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in reference]
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)


def test_preemption_picks_the_latest_running_request_under_fcfs(make_scheduler, make_request, fake_model):
    sched = make_scheduler(num_blocks=5, block_size=4)  # 16 tokens of KV
    a, b = make_request(7, max_tokens=9), make_request(7, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    model = fake_model(sched)
    out = sched.schedule()  # 2 pages each
    sched.update(out, model(out))
    out = sched.schedule()  # both decode at position 7: still 2 pages each
    sched.update(out, model(out))
    out = sched.schedule()  # a needs a third page: b goes
    assert [s.request_id for s in out.seqs] == [a.request_id]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.waiting == [b] and sched.running == [a]
    assert sched.block_manager.block_ids(b.request_id) == []
    assert sched.num_preemptions == 1


def test_priority_preempts_the_lowest_priority_even_if_already_scheduled(
    make_scheduler, make_request, fake_model, accounting
):
    sched = make_scheduler(num_blocks=5, block_size=4, policy="priority")  # 16 tokens of KV
    model = fake_model(sched)
    low = make_request(5, max_tokens=9, priority=5)
    sched.add_request(low)
    out = sched.schedule()
    sched.update(out, model(out))
    high = make_request(7, max_tokens=9, priority=0)
    sched.add_request(high)  # admitted after low, so low comes first in running
    for _ in range(2):
        out = sched.schedule()
        assert [s.request_id for s in out.seqs] == [low.request_id, high.request_id]
        sched.update(out, model(out))
    # low (8 tokens) still fits its 2 pages and gets its row; then high (9 tokens) needs a
    # third page and the only victim is low, whose row is taken back.
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == [high.request_id]
    assert out.num_tokens == 1
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert sched.waiting == [low] and sched.num_preemptions == 1
    accounting(sched)
    sched.update(out, model(out))
    assert (low.num_output_tokens, high.num_output_tokens) == (3, 3)  # low keeps its tokens


def test_priority_policy_admits_by_priority_then_arrival(make_scheduler, make_request, run):
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    reqs = [make_request(4, max_tokens=2, priority=p) for p in (3, 1, 2, 1, 0)]
    for r in reqs:
        sched.add_request(r)
    steps = run(sched)
    order = []
    for out in steps:
        rid = out.seqs[0].request_id
        if not order or order[-1] != rid:
            order.append(rid)
    assert order == ["req-4", "req-1", "req-3", "req-2", "req-0"]


def test_fcfs_admits_in_arrival_order(make_scheduler, make_request, run):
    sched = make_scheduler(max_num_seqs=1)
    for p in (3, 1, 2):
        sched.add_request(make_request(4, max_tokens=2, priority=p))
    first_rows = [out.seqs[0].request_id for out in run(sched)]
    assert first_rows == ["req-0", "req-0", "req-1", "req-1", "req-2", "req-2"]


def test_prefix_cache_hits_skip_the_shared_prefix(make_scheduler, make_request, fake_model, run):
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    model = fake_model(sched)  # one KV store across runs: cache hits read it
    prefix = list(range(2, 14))  # 3 full pages
    first = make_request(prefix + [50, 51], max_tokens=3)
    sched.add_request(first)
    run(sched, model)
    assert first.num_cached_tokens == 0

    second = make_request(prefix + [60, 61, 62], max_tokens=3)
    same = make_request(prefix, max_tokens=3)  # 12 tokens: the last page cannot be a hit
    sched.add_request(second)
    sched.add_request(same)
    rows = rows_by_request(run(sched, model))
    assert second.num_cached_tokens == 12
    assert rows[second.request_id][0][1:3] == (12, 3)
    assert same.num_cached_tokens == 8
    assert rows[same.request_id][0][1:3] == (8, 4)
    stats = sched.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 14 + 15 + 12, 20)

    # Same outputs as without the cache.
    plain = make_scheduler(block_size=4)
    again = [make_request(r.prompt_token_ids, max_tokens=3) for r in (first, second, same)]
    for r in again:
        plain.add_request(r)
    run(plain)
    assert [r.output_token_ids for r in again] == [r.output_token_ids for r in (first, second, same)]
    assert plain.prefix_cache_stats.queries == 0


def test_prefix_cache_covers_generated_tokens(make_scheduler, make_request, fake_model, run):
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    model = fake_model(sched)  # one KV store across runs: cache hits read it
    first = make_request(6, max_tokens=10)
    sched.add_request(first)
    run(sched, model)
    # A follow-up turn: the previous prompt and answer, then more.
    follow = make_request(first.all_token_ids + [70, 71], max_tokens=2)
    sched.add_request(follow)
    run(sched, model)
    assert follow.num_cached_tokens == 12  # 15 KV tokens were written: 3 full pages


def test_reset_prefix_cache(make_scheduler, make_request, fake_model, run):
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    model = fake_model(sched)  # one KV store across runs: cache hits read it
    sched.add_request(make_request(list(range(2, 12)), max_tokens=2))
    run(sched, model)
    assert sched.reset_prefix_cache()
    again = make_request(list(range(2, 12)), max_tokens=2)
    sched.add_request(again)
    run(sched, model)
    assert again.num_cached_tokens == 0


def fixed_tokens(tokens_by_request):
    """A token_fn that emits a scripted sequence per request."""

    def token_fn(req, context):  # the context ends with the last token fed before this one
        return tokens_by_request[req.request_id][len(context) - req.num_prompt_tokens]

    return token_fn


@pytest.mark.parametrize(
    "params, script, expected_out, status, stop_reason",
    [
        ({}, [5, 6, EOS, 7], [5, 6, EOS], RequestStatus.FINISHED_STOPPED, None),
        (
            {"ignore_eos": True},
            [5, EOS, 6, 7, 8, 9],
            [5, EOS, 6, 7, 8, 9],
            RequestStatus.FINISHED_LENGTH,
            None,
        ),
        ({"min_tokens": 3}, [EOS, 5, EOS, 6], [EOS, 5, EOS], RequestStatus.FINISHED_STOPPED, None),
        ({"stop_token_ids": [7, 8]}, [5, 8, 6], [5, 8], RequestStatus.FINISHED_STOPPED, 8),
        ({"stop_token_ids": [7], "min_tokens": 2}, [7, 7, 6], [7, 7], RequestStatus.FINISHED_STOPPED, 7),
        ({}, [5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10], RequestStatus.FINISHED_LENGTH, None),
        # The token that reaches max_tokens is eos: stopped, as vLLM checks eos first.
        ({}, [5, 6, 7, 8, 9, EOS], [5, 6, 7, 8, 9, EOS], RequestStatus.FINISHED_STOPPED, None),
    ],
)
def test_stop_conditions(
    make_scheduler, make_request, fake_model, run, params, script, expected_out, status, stop_reason
):
    sched = make_scheduler()
    req = make_request(5, max_tokens=6, **params)
    sched.add_request(req)
    run(sched, fake_model(sched, fixed_tokens({req.request_id: script})))
    assert req.output_token_ids == expected_out
    assert req.status == status
    assert req.stop_reason == stop_reason


def test_max_model_len_finishes_with_length(make_scheduler, make_request, run):
    sched = make_scheduler(max_model_len=12)
    req = make_request(8, max_tokens=100)
    sched.add_request(req)
    run(sched)
    assert req.num_tokens == 12 and req.status == RequestStatus.FINISHED_LENGTH


def test_abort_waiting_and_running(make_scheduler, make_request, fake_model, run, accounting):
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = (make_request(6, max_tokens=8) for _ in range(3))
    for r in (a, b, c):
        sched.add_request(r)
    model = fake_model(sched)
    out = sched.schedule()
    sched.update(out, model(out))
    assert sched.running == [a, b] and sched.waiting == [c]

    sched.finish_requests([c.request_id, "no-such-request"], RequestStatus.FINISHED_ABORTED)
    assert c.status == RequestStatus.FINISHED_ABORTED and c.status.finish_reason == "abort"
    assert sched.waiting == []
    # Abort a after it was scheduled: its sampled token is dropped on update.
    out = sched.schedule()
    sched.finish_requests(a.request_id, RequestStatus.FINISHED_ABORTED)
    accounting(sched)
    updated = sched.update(out, model(out))
    assert updated == [b]
    assert a.num_output_tokens == 1 and a.status == RequestStatus.FINISHED_ABORTED
    assert sched.block_manager.block_ids(a.request_id) == []
    run(sched, model)
    assert b.status == RequestStatus.FINISHED_LENGTH
    sched.finish_requests(b.request_id, RequestStatus.FINISHED_ABORTED)  # already finished: ignored
    assert b.status == RequestStatus.FINISHED_LENGTH


def test_stop_string_finish_sets_the_reason(make_scheduler, make_request, fake_model, accounting):
    sched = make_scheduler()
    req = make_request(6, max_tokens=8)
    sched.add_request(req)
    model = fake_model(sched)
    out = sched.schedule()
    sched.update(out, model(out))
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_STOPPED, stop_reason="\n\n")
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == "\n\n"
    assert not sched.has_unfinished_requests()
    accounting(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks


def test_update_returns_only_requests_that_sampled(make_scheduler, make_request, fake_model):
    sched = make_scheduler(max_num_batched_tokens=8)
    short, long = make_request(3, max_tokens=5), make_request(20, max_tokens=5)
    sched.add_request(short)
    sched.add_request(long)
    model = fake_model(sched)
    out = sched.schedule()
    assert [s.sampling is not None for s in out.seqs] == [True, False]
    assert sched.update(out, model(out)) == [short]
    empty = ModelRunnerOutput((), np.zeros(0, np.int32), np.zeros(0, np.float32))
    out = sched.schedule()
    assert sched.update(out, empty) == []


def _step(sched, model, at: float) -> set[str]:
    """One step at time `at` on the scheduler's clock: the requests it started."""
    sched.clock = lambda: at
    before = {r.request_id for r in sched.running}
    out = sched.schedule()
    sched.update(out, model(out))
    return {s.request_id for s in out.seqs} - before


@pytest.mark.parametrize("delay_factor", [0.0, 0.5])
def test_scheduler_delay_factor_holds_new_prompts_to_start_them_together(
    make_scheduler, make_request, fake_model, delay_factor
):
    """vLLM's scheduler_delay_factor: while requests run, a new prompt waits until the oldest
    waiting one has waited delay_factor x the last prompt step's length (here 1.0 s: the step
    at t=0 started a prompt, the next came at t=1)."""
    sched = make_scheduler(max_num_batched_tokens=64, delay_factor=delay_factor)
    model = fake_model(sched)
    sched.add_request(make_request(8, max_tokens=30, arrival_time=0.0))
    assert _step(sched, model, 0.0) == {"req-0"}  # nothing runs: no waiting
    sched.add_request(make_request(8, max_tokens=4, arrival_time=1.0))
    started = [_step(sched, model, t) for t in (1.0, 1.2)]
    sched.add_request(make_request(8, max_tokens=4, arrival_time=1.3))
    started += [_step(sched, model, t) for t in (1.4, 1.6)]
    if delay_factor == 0:  # each prompt starts at the first step after it came
        assert started == [{"req-1"}, set(), {"req-2"}, set()]
    else:  # req-1 waited 0.6 s > 0.5 x 1.0 s at t=1.6, and req-2 started beside it
        assert started == [set(), set(), set(), {"req-1", "req-2"}]


def test_scheduler_delay_factor_never_holds_prompts_when_nothing_runs(
    make_scheduler, make_request, fake_model
):
    sched = make_scheduler(max_num_batched_tokens=64, delay_factor=100.0)
    model = fake_model(sched)
    sched.add_request(make_request(8, max_tokens=1, arrival_time=0.0))
    assert _step(sched, model, 0.0) == {"req-0"}
    assert sched.num_running == 0  # one token: finished in its first step
    sched.add_request(make_request(8, max_tokens=1, arrival_time=5.0))
    assert _step(sched, model, 5.0) == {"req-1"}
