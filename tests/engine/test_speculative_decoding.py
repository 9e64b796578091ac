"""Speculative decoding through the whole engine: with n-gram, suffix or draft-model proposals, every request
gets exactly the tokens (and logprobs, text, finish reasons) it gets without them, greedy or
seeded, with penalties, stop strings, n > 1 and max_tokens edges, while proposals are kept."""

from __future__ import annotations

import re

import pytest
from tiny_models import engine_kwargs

from jaxserve import LLM, SamplingParams

SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0},
}
# prompts whose greedy continuations on the tiny model repeat (so proposals are made and kept)
PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]},
    {"prompt_token_ids": list(range(40, 60)) * 2},
    {"prompt_token_ids": [11, 12, 13]},
    {"prompt_token_ids": [300 + i % 7 for i in range(50)]},
]


def _kwargs(**spec):
    return engine_kwargs(max_model_len=256, **spec)


@pytest.fixture(scope="module")
def plain(tiny_llama_gqa):
    return LLM(tiny_llama_gqa[0], **_kwargs())


@pytest.fixture(scope="module", params=[*sorted(SPECS), "draft_model"])
def spec(request, tiny_llama_gqa):
    # the draft model: the target itself, whose greedy proposals the target keeps (nearly) all
    config = SPECS.get(request.param) or {
        "method": "draft_model",
        "model": tiny_llama_gqa[0],
        "num_speculative_tokens": 3,
    }
    return LLM(tiny_llama_gqa[0], **_kwargs(speculative_config=config))


def _same(plain, spec, params, prompts=PROMPTS):
    expected = plain.generate(prompts, params, use_tqdm=False)
    before = spec.llm_engine.scheduler.spec_stats.snapshot()
    got = spec.generate(prompts, params, use_tqdm=False)
    for e, g in zip(expected, got, strict=True):
        for a, b in zip(e.outputs, g.outputs, strict=True):
            assert b.token_ids == a.token_ids
            assert b.text == a.text
            assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason)
            if a.logprobs is not None:
                assert [list(x) for x in b.logprobs] == [list(x) for x in a.logprobs]
                for x, y in zip(a.logprobs, b.logprobs):
                    for t in x:
                        assert y[t].logprob == pytest.approx(x[t].logprob, abs=1e-4)
            if a.cumulative_logprob is not None:
                assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
    return spec.llm_engine.scheduler.spec_stats.since(before)


def test_greedy_tokens_equal_and_proposals_are_kept(plain, spec):
    stats = _same(plain, spec, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    assert stats.num_drafts > 0 and stats.accepted_per_pos[1] > 0  # some rows kept two proposals or more
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert stats.accepted_per_pos == sorted(stats.accepted_per_pos, reverse=True)
    if spec.llm_engine.config.speculative_config.method == "draft_model":
        # its own proposals: only the numerics of other row counts may differ, at near-ties
        assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens


def test_seeded_sampling_penalties_and_logprobs_equal(plain, spec):
    params = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=20, seed=5, max_tokens=32, logprobs=2, ignore_eos=True,
        presence_penalty=-0.5, repetition_penalty=1.1,
    )  # fmt: skip
    _same(plain, spec, params)


def test_stop_strings_tokens_and_lengths_cut_where_they_would_be(plain, spec):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = plain.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0]
    token = text.token_ids[9]
    middle = text.text[len(text.text) // 2 : len(text.text) // 2 + 2]
    for params in (
        SamplingParams(temperature=0, max_tokens=40, stop=[middle]),
        SamplingParams(temperature=0, max_tokens=40, stop=[middle], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[token]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # the last proposals cut by length
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20, ignore_eos=False),
    ):
        _same(plain, spec, params)


def test_several_samples_of_one_prompt(plain, spec):
    _same(plain, spec, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_start_up_compiles_the_verify_kind_and_no_request_compiles(tiny_llama_gqa, method):
    config = SPECS.get(method) or {"method": method, "model": tiny_llama_gqa[0], "num_speculative_tokens": 3}
    llm = LLM(tiny_llama_gqa[0], **_kwargs(speculative_config=config, enforce_eager=False))
    runner = llm.llm_engine.runner
    runner.wait_compiled()
    compiled = runner.num_compiled
    assert compiled == 2 * len(runner.buckets.all())  # each bucket's generate and verify programs
    proposer = llm.llm_engine.scheduler.proposer
    drafts = dict(getattr(proposer, "_compiled", {}))  # a draft model's programs, one a bucket
    assert len(drafts) == (len(runner.buckets.all()) if method == "draft_model" else 0)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert runner.num_compiled == compiled
    assert dict(getattr(proposer, "_compiled", {})) == drafts


def test_metrics_and_stats_line_count_proposals(spec):
    from jaxserve.engine.stats import SchedulerStats
    from jaxserve.metrics import EngineMetrics, StatsLogger

    metrics, log = EngineMetrics("m", 256, 64), StatsLogger()
    engine = spec.llm_engine
    before = SchedulerStats.of(engine.scheduler)
    metrics.record(before, engine.iteration_stats)
    log.record(before, engine.iteration_stats)
    spec.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    after = SchedulerStats.of(engine.scheduler)
    metrics.record(after, engine.iteration_stats)
    log.record(after, engine.iteration_stats)
    new = after.spec  # (new counters and a first window count from the engine's start)
    assert new.num_drafts > before.spec.num_drafts
    text = metrics.render().decode()
    assert f'jaxserve:spec_decode_num_drafts_total{{model_name="m"}} {float(new.num_drafts)}' in text
    assert (
        f'jaxserve:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(new.num_accepted_tokens)}'
        in text
    )
    assert (
        f'jaxserve:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(new.num_draft_tokens)}' in text
    )
    first = new.accepted_per_pos[0]
    assert (
        f'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {float(first)}'
        in text
    )
    line = log.line()
    assert "SpecDecoding metrics: Mean acceptance length" in line
    assert f"Accepted: {new.num_accepted_tokens} tokens, Drafted: {new.num_draft_tokens} tokens" in line


class FixedProposer:
    """Proposes the same tokens after every token: a draft distribution far from the model's."""

    needs_pages = False

    def __init__(self, tokens):
        self.tokens = list(tokens)

    def propose(self, request_id, token_ids, num_prompt_tokens, k):
        return self.tokens[:k]

    def finish(self, request_id, token_ids, num_prompt_tokens):
        pass


# Chi-square critical value at p = 0.001 for the degrees of freedom a table of n categories has
# (n - 1): a correct sampler fails the test one run in a thousand; the seeds are fixed, so it
# either always passes or always fails.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
            10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}  # fmt: skip


# (the tiny model's logits are nearly flat: low temperatures and top-k make few likely pairs)
@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.05}, {"temperature": 0.1, "top_p": 0.5}, {"temperature": 2.0, "top_k": 3}]
)
def test_sampled_tokens_keep_the_target_distribution_under_far_proposals(plain, tiny_llama_gqa, sampling):
    """Two independent samples (disjoint seeds) of the second and third output tokens, one without
    proposals and one with fixed proposals the model rarely agrees with, are one distribution by a
    two-sample chi-square test over their (second, third) pairs (rare pairs pooled)."""
    n = 1500
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}

    def pairs(llm, seeds):
        params = [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, **sampling) for s in seeds]
        return [tuple(o.outputs[0].token_ids[1:]) for o in llm.generate([prompt] * n, params, use_tqdm=False)]

    base = pairs(plain, range(n))
    counts = {}
    for p in base:
        counts[p] = counts.get(p, 0) + 1
    common = [p for p, c in sorted(counts.items(), key=lambda pc: -pc[1]) if c >= 20][:15]
    # proposals: the least likely of the common pairs, every time (often wrong, sometimes right)
    rare = min(common, key=counts.get)
    spec = LLM(tiny_llama_gqa[0], **_kwargs(speculative_config=SPECS["ngram"]))
    spec.llm_engine.scheduler.proposer = FixedProposer(rare)
    before = spec.llm_engine.scheduler.spec_stats.snapshot()
    other = pairs(spec, range(n, 2 * n))
    stats = spec.llm_engine.scheduler.spec_stats.since(before)
    assert stats.num_draft_tokens >= n and 0 < stats.num_accepted_tokens < stats.num_draft_tokens / 2
    table = [
        [sum(x == p for x in xs) for p in common] + [sum(x not in common for x in xs)] for xs in (base, other)
    ]
    table = [[row[j] for j in range(len(row)) if table[0][j] + table[1][j] > 0] for row in table]
    columns = [a + b for a, b in zip(*table)]
    chi2 = sum(
        (table[i][j] - columns[j] / 2) ** 2 / (columns[j] / 2) for i in range(2) for j in range(len(columns))
    )
    assert len(columns) >= 3, "too few categories to compare"
    assert chi2 < CHI2_999[len(columns) - 1], (chi2, table)


def test_constrained_rows_beside_rows_with_proposals(plain, spec, tiny_llama_gqa):
    """A step with proposals and a grammar's mask (the verify kind with a token mask): the
    constrained rows follow their grammar, take no proposals, and every row's tokens equal the
    run without proposals."""
    from jaxserve.sampling_params import StructuredOutputsParams

    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    digits = SamplingParams(
        temperature=0.7, seed=5, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=r"\d{5}")
    )
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[1]]
    params = [greedy, digits, greedy, digits]
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    before = spec.llm_engine.scheduler.spec_stats.snapshot()
    got = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert spec.llm_engine.scheduler.spec_stats.since(before).num_accepted_tokens > 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g in got[1::2]:
        assert re.fullmatch(r"\d{5}", g.text)


def test_a_draft_of_another_vocabulary_or_none_at_all_is_refused_at_start_up(tiny_llama_gqa, tmp_path):
    from tiny_models import TINY_LLAMA, make_checkpoint

    other = tmp_path / "other-vocab"
    make_checkpoint(
        str(other), "LlamaConfig", "LlamaForCausalLM", {**TINY_LLAMA, "vocab_size": 384}, "float32", 0
    )
    draft = {"method": "draft_model", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"vocabulary of 384 tokens.*must share the target's tokenizer"):
        LLM(tiny_llama_gqa[0], **_kwargs(speculative_config={**draft, "model": str(other)}))
    with pytest.raises(ValueError, match=r"^--speculative-config model '.*missing'"):
        LLM(tiny_llama_gqa[0], **_kwargs(speculative_config={**draft, "model": str(tmp_path / "missing")}))


@pytest.mark.parametrize("level", [1, 2])
def test_a_draft_model_sleeps_and_wakes_with_the_engine(tiny_llama_gqa, level):
    draft = {"method": "draft_model", "model": tiny_llama_gqa[0], "num_speculative_tokens": 3}
    llm = LLM(tiny_llama_gqa[0], **_kwargs(speculative_config=draft, enable_sleep_mode=True))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    draft_runner = llm.llm_engine.draft.runner
    llm.sleep(level)
    assert set(draft_runner.released) == {"weights", "kv_cache"} and not llm.llm_engine.draft.cached
    llm.wake_up()
    assert draft_runner.released == ()
    stats = llm.llm_engine.scheduler.spec_stats
    start = stats.snapshot()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == before
    again = stats.since(start)
    assert again.num_accepted_tokens >= 0.95 * again.num_draft_tokens > 0  # its weights came back


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_preempted_requests_with_proposals_give_the_same_tokens(plain, tiny_llama_gqa, method):
    """A pool too small for the batch: requests are preempted (their pages, and a draft model's
    cache of them, gone) and recomputed, with the same tokens as without proposals."""
    config = SPECS.get(method) or {"method": method, "model": tiny_llama_gqa[0], "num_speculative_tokens": 3}
    llm = LLM(tiny_llama_gqa[0], **_kwargs(speculative_config=config, num_gpu_blocks_override=20))
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert got == want
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_no_proposals_while_the_batch_is_larger_than_disable_by_batch_size(plain, tiny_llama_gqa):
    """disable_by_batch_size 2: four requests decode without proposals (and asynchronously) until
    the two short ones end; the long ones then get proposals; tokens as without proposals."""
    config = {**SPECS["ngram"], "disable_by_batch_size": 2}
    llm = LLM(tiny_llama_gqa[0], **_kwargs(speculative_config=config, async_scheduling=True))
    stats = llm.llm_engine.scheduler.spec_stats
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 6, 40, 6)]
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want
    assert stats.num_accepted_tokens > 0
    before = stats.snapshot()
    same = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)  # four to the end
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, same, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, same, use_tqdm=False)] == want
    assert stats.since(before).num_drafts == 0


def test_a_draft_models_pool_comes_out_of_the_same_kv_budget(tiny_llama_gqa):
    """With --kv-cache-memory-bytes (or the device's free memory), the target's pool and the
    draft's, as many blocks each, share the budget: half the blocks with a draft the size of the
    target."""
    budget = 64 * 1024
    kw = _kwargs(num_gpu_blocks_override=None, kv_cache_memory_bytes=budget)
    alone = LLM(tiny_llama_gqa[0], **kw).llm_engine.runner
    draft = {"method": "draft_model", "model": tiny_llama_gqa[0], "num_speculative_tokens": 2}
    both = LLM(tiny_llama_gqa[0], **{**kw, "speculative_config": draft}).llm_engine
    per_block = alone.kv_spec.bytes_per_block
    assert alone.num_blocks == budget // per_block
    assert both.runner.num_blocks == budget // (2 * per_block) == both.draft.runner.num_blocks
    assert both.runner.kv_pool.nbytes + both.draft.runner.kv_pool.nbytes <= budget


def test_steps_run_ahead_where_no_proposal_is_likely(plain, tiny_llama_gqa):
    """An n-gram engine waits for a step's tokens before planning the next only where the
    proposer finds a proposal on the tokens known then: text that repeats nothing of 4 tokens
    (prompt_lookup_min 4) is planned ahead like a plain engine's, and gives its tokens."""
    if not plain.llm_engine.async_scheduling:
        pytest.skip("synchronous scheduling waits for every step's tokens")
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 4}
    spec = LLM(tiny_llama_gqa[0], **_kwargs(speculative_config=config))
    scheduler = spec.llm_engine.scheduler
    waits = []
    decide = scheduler.needs_tokens_before_next
    scheduler.needs_tokens_before_next = lambda sched: waits.append(decide(sched)) or waits[-1]
    distinct = [{"prompt_token_ids": [3 + 7 * i % 500 for i in range(30)]}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = spec.generate(distinct, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == plain.generate(distinct, params, use_tqdm=False)[0].outputs[0].token_ids
    assert scheduler.spec_stats.num_drafts == 0 and waits and not any(waits)
    waits.clear()  # a prompt that repeats itself: the next step waits, and is proposed for
    _same(plain, spec, SamplingParams(max_tokens=12, temperature=0.0), PROMPTS[:1])
    assert any(waits) and scheduler.spec_stats.num_drafts > 0
