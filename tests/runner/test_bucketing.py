"""Step shapes: the (num_tokens, num_seqs) buckets the compilation config gives, the one each
step is padded to, and the order start-up compiles them in."""

from __future__ import annotations

import pytest

from jaxserve.config import CompilationConfig, SchedulerConfig
from jaxserve.runner.bucketing import FIRST_PREFILL_TOKENS, Buckets


def test_derived_token_buckets_are_powers_of_two_up_to_the_budget():
    sched = SchedulerConfig(max_num_batched_tokens=200, max_num_seqs=8)
    accelerator = Buckets.from_config(sched, CompilationConfig(min_token_bucket=16))
    assert accelerator.tokens == (16, 32, 64, 128, 200) and accelerator.seqs == (8,)
    cpu = Buckets.from_config(sched, CompilationConfig(min_token_bucket=1))
    assert cpu.tokens == (1, 2, 4, 8, 16, 32, 64, 128, 200) and cpu.seqs == (1, 2, 4, 8)
    # one sequence bucket per token bucket: as many sequences as tokens, up to max_num_seqs
    assert cpu.all() == [(t, min(t, 8)) for t in cpu.tokens]


@pytest.mark.parametrize(
    "compilation",
    [
        CompilationConfig(min_token_bucket=16),
        CompilationConfig(token_buckets=(8, 64, 200), seq_buckets=(2, 8)),
    ],
    ids=["derived", "explicit"],
)
def test_every_step_is_padded_to_the_smallest_bucket_that_holds_it(compilation):
    buckets = Buckets.from_config(SchedulerConfig(max_num_batched_tokens=200, max_num_seqs=8), compilation)
    compiled = set(buckets.all())
    for num_tokens in range(1, 201):
        for num_seqs in range(1, min(num_tokens, 8) + 1):  # every sequence feeds a token at least
            picked = buckets.pick(num_tokens, num_seqs)
            holding = [b for b in compiled if b[0] >= num_tokens and b[1] >= num_seqs]
            # fewest padded tokens first, then fewest padded sequences
            assert picked == min(holding), (num_tokens, num_seqs)


def test_buckets_that_do_not_reach_the_scheduler_limits_are_refused():
    sched = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8)
    with pytest.raises(ValueError, match="must reach max_num_batched_tokens=256"):
        Buckets.from_config(sched, CompilationConfig(token_buckets=(16, 128)))
    with pytest.raises(ValueError, match="max_num_seqs=8"):
        Buckets.from_config(sched, CompilationConfig(token_buckets=(16, 256), seq_buckets=(1, 4)))


def test_startup_order_is_the_decode_and_one_prefill_bucket_then_the_rest_smallest_first():
    buckets = Buckets.from_config(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256), CompilationConfig(min_token_bucket=1)
    )
    first, rest = buckets.startup_order()
    assert first == [1, FIRST_PREFILL_TOKENS]
    assert rest == [t for t in buckets.tokens if t not in first] and rest == sorted(rest)
    small = Buckets.from_config(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), CompilationConfig(min_token_bucket=1)
    )
    assert small.startup_order() == ([1, 64], [2, 4, 8, 16, 32])


def test_a_subset_picks_only_its_own_buckets():
    buckets = Buckets.from_config(
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8), CompilationConfig(min_token_bucket=1)
    )
    ready = buckets.subset([1, 128])
    assert ready.pick(1, 1) == (1, 1)
    assert ready.pick(3, 3) == (128, 8)  # nothing between 1 and 128 is compiled yet
    assert ready.pick(128, 8) == (128, 8)
    assert buckets.pick(3, 3) == (4, 4)
