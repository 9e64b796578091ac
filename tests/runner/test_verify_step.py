"""The verify step (speculative decoding, runner/step.py): a sequence fed proposed tokens keeps
the samples that agree with them plus one, and every kept token is the one a step without
proposals samples at that output index: greedy, seeded random sampling and penalties alike."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import engine_kwargs

from jaxserve.args import EngineArgs
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step import StepVariant
from jaxserve.scheduler_output import (
    LogitsSpec,
    ProcessorSlotInit,
    SamplingRow,
    ScheduledSeq,
    SchedulerOutput,
)

PROMPT = tuple(range(3, 14))
K = 3


@pytest.fixture(scope="module")
def runner(tiny_llama_gqa):
    kw = engine_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": K}, max_model_len=48)
    return ModelRunner(EngineArgs(model=tiny_llama_gqa[0], **kw).create_engine_config())


ROWS = {
    "greedy": SamplingRow(0.0, 0, 1.0, 0.0, 0, len(PROMPT)),
    "seeded": SamplingRow(1.0, 0, 1.0, 0.0, 1234, len(PROMPT)),
    # negative penalties: a token sampled once is likely again, so a row that failed to count the
    # proposals before it would sample differently
    "penalised": SamplingRow(
        0.7,
        0,
        0.95,
        0.0,
        7,
        len(PROMPT),
        presence_penalty=-3.0,
        frequency_penalty=-0.4,
        repetition_penalty=1.2,
    ),
}


def _run(runner, req: str, blocks: tuple, row: SamplingRow, proposals, steps: int) -> list[int]:
    """The tokens one sequence samples: a prefill, then decode steps fed `proposals(outputs)`
    after its last token (no proposal: a plain step)."""
    init = None
    if row.repetition_penalty != 1.0:  # penalties: the row's processor slot, filled on the first step
        slot = {"a": 0, "b": 1}[req]
        row = dataclasses.replace(row, processor_slot=slot)
        init = ProcessorSlotInit(slot, LogitsSpec(), PROMPT, ())
    out = runner.execute(SchedulerOutput((ScheduledSeq(req, PROMPT, 0, blocks, row, init),)))
    outputs = [int(out.sampled_token_ids[0])]
    for _ in range(steps):
        drafts = tuple(proposals(outputs))
        start = len(PROMPT) + len(outputs) - 1
        seq = ScheduledSeq(req, (outputs[-1], *drafts), start, blocks, row, num_drafts=len(drafts))
        sched = SchedulerOutput((seq,))
        assert StepVariant.for_batch(sched).kind == ("verify" if drafts else "generate")
        out = runner.execute(sched)
        kept = out.sampled_token_ids.tolist()
        assert len(kept) == (1 if out.num_sampled is None else int(out.num_sampled[0]))
        assert 1 <= len(kept) <= len(drafts) + 1
        assert kept[:-1] == list(drafts[: len(kept) - 1])  # the proposals kept are a prefix
        outputs += kept
    return outputs


@pytest.mark.parametrize("kind", sorted(ROWS))
def test_kept_tokens_are_the_tokens_of_plain_steps(runner, kind):
    row = ROWS[kind]
    plain = _run(runner, "a", (1, 2, 3, 4, 5, 6), row, lambda out: (), 16)

    # proposals right for two tokens, then wrong: each step keeps three (two and the correction)
    def half_right(out):
        n = len(out)
        right = plain[n : n + 2]
        return (
            (*right, (plain[n + 2] + 1) % 97 if n + 2 < len(plain) else 5)[:K] if n + 3 <= len(plain) else ()
        )

    spec = _run(runner, "b", (7, 8, 9, 10, 11, 12), row, half_right, 8)
    assert spec[: len(plain)] == plain[: len(spec)]
    assert len(spec) > 12  # most steps kept three tokens
    # all right: every step keeps K + 1
    spec = _run(runner, "b", (7, 8, 9, 10, 11, 12), row, lambda out: tuple(plain[len(out) : len(out) + K]), 4)
    assert spec[: len(plain)] == plain[: len(spec)]
    assert len(spec) == 1 + 4 * (K + 1)


def test_masked_variants_share_one_forward_program_per_input_shape(runner):
    """The forward half of a masked step reads no sampling option: variants that differ in those
    alone compile it once (per kind: the verify layout's inputs have other shapes)."""
    bucket = runner.buckets.all()[0]
    plain = StepVariant(with_token_bitmask=True)
    for other in (
        StepVariant(with_token_bitmask=True, with_top_logprobs=True, with_processor_state=True),
        StepVariant(with_token_bitmask=True, kind="verify"),
    ):
        same = runner.steps.compile(bucket, other)[0] is runner.steps.compile(bucket, plain)[0]
        assert same == (other.kind == plain.kind)
    with_prompt = StepVariant(with_token_bitmask=True, with_prompt_logprobs=True)
    assert runner.steps.compile(bucket, with_prompt)[0] is not runner.steps.compile(bucket, plain)[0]
