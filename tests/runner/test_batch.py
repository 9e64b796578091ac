"""One step's padded arrays from a SchedulerOutput (runner/batch.py), laid out as the model and
the attention read them: the fed tokens of every sequence back to back with their positions and
KV slots, then padding whose KV writes are dropped; per-sequence page tables, lengths, row
offsets and sampling settings, then padding sequences with no tokens."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.runner.batch import PackedBatch, prepare
from jaxserve.scheduler_output import MAX_BANNED_TOKENS, SamplingRow, ScheduledSeq, SchedulerOutput

PAGE = 4
PAGES_PER_SEQ = 3
PAD_SLOT = 1000  # past any pool these tests describe

SAMPLED = SamplingRow(
    temperature=0.7,
    top_k=5,
    top_p=0.9,
    min_p=0.05,
    seed=2**32 + 7,  # the request's seed, kept to its low 32 bits on the device
    output_start=4,  # decoding position 6, so sampling position 7: output 3
    banned_token_ids=(4, 9),
    presence_penalty=0.5,
    frequency_penalty=0.25,
    repetition_penalty=1.1,
    processor_slot=2,
)
GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, output_start=6)

STEP = SchedulerOutput(
    (
        # a prompt's first chunk, not at its end yet: nothing sampled; pages 3 and 7
        ScheduledSeq("a", (10, 11, 12, 13, 14), 0, (3, 7), None),
        # a decode of the token at position 6: its second page, 2
        ScheduledSeq("b", (20,), 6, (5, 2), SAMPLED),
        # the last chunk of a 6-token prompt on 3 cached tokens, with prompt logprobs
        ScheduledSeq("c", (30, 31, 32), 3, (4, 6), GREEDY, prompt_logprob_targets=(31, 32)),
    )
)


def _pad(values, size, fill):
    return [*values, *[fill] * (size - len(values))]


def test_tokens_positions_and_slots_back_to_back_then_padding():
    inputs = prepare(STEP, 16, 4, PAGE, PAGES_PER_SEQ, PAD_SLOT, "reference")
    assert inputs.input_ids.tolist() == _pad([10, 11, 12, 13, 14, 20, 30, 31, 32], 16, 0)
    assert inputs.positions.tolist() == _pad([0, 1, 2, 3, 4, 6, 3, 4, 5], 16, 0)
    # slot = page * PAGE + position % PAGE, the page being the sequence's table entry
    # position // PAGE; padding tokens write to PAD_SLOT
    a = [3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 7 * 4 + 0]
    b = [2 * 4 + 2]
    c = [4 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1]
    assert inputs.meta.slot_mapping.tolist() == _pad(a + b + c, 16, PAD_SLOT)
    # prompt_logprobs: each fed token's successor in the prompt; -1 where none is wanted
    assert inputs.prompt_targets.tolist() == _pad([-1] * 6 + [31, 32], 16, -1)


def test_per_sequence_arrays_padded_to_the_sequence_bucket():
    inputs = prepare(STEP, 16, 4, PAGE, PAGES_PER_SEQ, PAD_SLOT, "reference")
    meta = inputs.meta
    assert meta.num_seqs.tolist() == [3]
    assert meta.cu_q_lens.tolist() == [0, 5, 6, 9, 9]  # a padding sequence has no rows
    assert meta.kv_lens.tolist() == [5, 7, 6, 0]  # cached + fed tokens
    assert meta.page_indices.tolist() == [[3, 7, 0], [5, 2, 0], [4, 6, 0], [0, 0, 0]]
    assert inputs.logits_indices.tolist() == [4, 5, 8, 0]  # each sequence's last fed token
    for array in (inputs.input_ids, inputs.positions, meta.slot_mapping, meta.page_indices, meta.cu_q_lens):
        assert array.dtype == np.int32


def test_sampling_rows_and_their_neutral_padding():
    s = prepare(STEP, 16, 4, PAGE, PAGES_PER_SEQ, PAD_SLOT, "reference").sampling
    # row 0 samples nothing and the padding row 3 neither: greedy, no filters, no penalties
    np.testing.assert_array_equal(s.temperature, np.float32([0, 0.7, 0, 0]))
    np.testing.assert_array_equal(s.top_k, [0, 5, 0, 0])
    np.testing.assert_array_equal(s.top_p, np.float32([1, 0.9, 1, 1]))
    np.testing.assert_array_equal(s.min_p, np.float32([0, 0.05, 0, 0]))
    np.testing.assert_array_equal(s.seeds, [0, 7, 0, 0])
    np.testing.assert_array_equal(s.steps, [0, 3, 0, 0])
    np.testing.assert_array_equal(s.presence, np.float32([0, 0.5, 0, 0]))
    np.testing.assert_array_equal(s.frequency, np.float32([0, 0.25, 0, 0]))
    np.testing.assert_array_equal(s.repetition, np.float32([1, 1.1, 1, 1]))
    np.testing.assert_array_equal(s.processor_slot, [-1, 2, -1, -1])
    assert s.banned.shape == (4, MAX_BANNED_TOKENS)
    assert s.banned[1].tolist() == _pad([4, 9], MAX_BANNED_TOKENS, -1)
    assert (np.delete(s.banned, 1, axis=0) == -1).all()


def test_an_empty_step_is_all_padding():
    inputs = prepare(SchedulerOutput(()), 8, 2, PAGE, PAGES_PER_SEQ, PAD_SLOT, "reference")
    assert inputs.meta.num_seqs.tolist() == [0]
    assert inputs.meta.cu_q_lens.tolist() == [0, 0, 0]
    assert inputs.meta.slot_mapping.tolist() == [PAD_SLOT] * 8
    assert not inputs.meta.kv_lens.any() and not inputs.meta.page_indices.any()


@pytest.mark.parametrize("bucket", [(8, 4), (16, 2)], ids=["too-many-tokens", "too-many-seqs"])
def test_a_step_larger_than_its_bucket_is_refused(bucket):
    with pytest.raises(ValueError, match=r"step of 9 tokens / 3 seqs exceeds bucket"):
        prepare(STEP, *bucket, PAGE, PAGES_PER_SEQ, PAD_SLOT, "reference")


def test_the_packed_transfer_unpacks_to_the_same_arrays():
    """One buffer on the way to the device; every array back with its shape, dtype and values
    (floats bit for bit, the seeds' full 32 bits included)."""
    inputs = prepare(STEP, 16, 4, PAGE, PAGES_PER_SEQ, PAD_SLOT, "reference")
    packed = PackedBatch.pack(inputs)
    assert packed.words.dtype == np.int32 and packed.words.ndim == 1
    back = jax.jit(PackedBatch.unpack)(jax.device_put(packed))
    assert jax.tree.structure(back) == jax.tree.structure(inputs)  # the backend too
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(inputs), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
    assert inputs.sampling.seeds[1] == 7 and inputs.sampling.seeds.dtype == np.uint32
