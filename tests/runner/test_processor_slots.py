"""ProcessorSlots: a request's rows land in its slot alone, as the sampler expects to read them."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.runner.processor_slots import ProcessorSlots
from jaxserve.scheduler_output import LogitsSpec, ProcessorSlotInit

VOCAB = 16


def _slots() -> ProcessorSlots:
    mesh = jax.make_mesh((1,), ("model",), devices=jax.devices()[:1])
    return ProcessorSlots(3, VOCAB, NamedSharding(mesh, PartitionSpec()))


def test_rows_are_allocated_on_first_use_as_zeros():
    slots = _slots()
    assert slots.state is None
    state = slots.current()
    assert state.prompt_mask.shape == state.output_counts.shape == state.bias.shape == (3, VOCAB)
    assert not np.asarray(state.prompt_mask).any() and not np.asarray(state.bias).any()
    assert slots.current() is state


def test_a_filled_slot_holds_its_mask_counts_and_bias_and_leaves_the_others():
    slots = _slots()
    slots.fill(ProcessorSlotInit(0, LogitsSpec(bias=((3, 2.5), (5, -1.0))), (1, 2, 2), ()))
    spec = LogitsSpec(bias=((7, 1.5), (7, 1.0)), allowed_token_ids=(4, 7, 9))
    slots.fill(ProcessorSlotInit(2, spec, (9,), (4, 4, 7)))  # a resumed request: its outputs are counted
    state = jax.tree.map(np.asarray, slots.current())

    mask = np.zeros((3, VOCAB), bool)
    mask[0, [1, 2]] = mask[2, 9] = True
    np.testing.assert_array_equal(state.prompt_mask, mask)
    counts = np.zeros((3, VOCAB), np.int32)
    counts[2, 4], counts[2, 7] = 2, 1
    np.testing.assert_array_equal(state.output_counts, counts)
    bias = np.zeros((3, VOCAB), np.float32)
    bias[0, 3], bias[0, 5] = 2.5, -1.0
    bias[2] = -np.inf
    bias[2, [4, 9]] = 0.0
    bias[2, 7] = 2.5  # an allowed token's biases add up
    np.testing.assert_array_equal(state.bias, bias)


def test_refilling_a_slot_replaces_the_previous_request_s_rows():
    slots = _slots()
    slots.fill(ProcessorSlotInit(1, LogitsSpec(allowed_token_ids=(0,)), (5, 6), (5,)))
    slots.fill(ProcessorSlotInit(1, LogitsSpec(), (2,), ()))
    state = jax.tree.map(np.asarray, slots.current())
    assert state.prompt_mask[1].nonzero()[0].tolist() == [2]
    assert not state.output_counts[1].any() and not state.bias[1].any()
