"""The device rows a request's logit processors read: one slot per running request that needs
them, holding its prompt-token mask (repetition penalty), its output-token counts (presence and
frequency penalties) and its bias (logit_bias, allowed_token_ids).

Where it sits: ModelRunner owns one. A request's row is written once, when the scheduler admits
it to a slot (ProcessorSlotInit: one transfer of three vocabulary-sized rows, never per step); the step
variant with_processor_state takes the state (donated), counts the tokens it samples and hands it
back (runner/step.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers.sampler import ProcessorState
from jaxserve.scheduler_output import ProcessorSlotInit


class ProcessorSlots:
    def __init__(self, num_slots: int, vocab_size: int, sharding: jax.sharding.Sharding) -> None:
        self.vocab_size = vocab_size
        shape = (num_slots, vocab_size)
        self._zeros = jax.jit(
            lambda: ProcessorState(
                jnp.zeros(shape, bool), jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)
            ),
            out_shardings=sharding,
        )
        self._write = jax.jit(_write_slot, donate_argnums=0)
        # the rows; None until a request first needs them (or after a failed step consumed them)
        self.state: ProcessorState | None = None

    def current(self) -> ProcessorState:
        """The rows, allocated (zeros) on first use."""
        if self.state is None:
            self.state = self._zeros()
        return self.state

    def fill(self, init: ProcessorSlotInit) -> None:
        """Write a request's mask, counts and bias into its slot."""
        vocab = self.vocab_size
        mask = np.zeros(vocab, bool)
        mask[list(init.prompt_token_ids)] = True
        counts = np.bincount(np.asarray(init.output_token_ids, np.int64), minlength=vocab).astype(np.int32)
        bias = np.zeros(vocab, np.float32)
        if init.spec.allowed_token_ids is not None:
            bias[:] = -np.inf
            bias[list(init.spec.allowed_token_ids)] = 0.0
        for token, value in init.spec.bias:
            bias[token] += value
        self.state = self._write(self.current(), np.int32(init.processor_slot), mask, counts[:vocab], bias)


def _write_slot(state: ProcessorState, slot, mask, counts, bias) -> ProcessorState:
    return ProcessorState(
        state.prompt_mask.at[slot].set(mask),
        state.output_counts.at[slot].set(counts),
        state.bias.at[slot].set(bias),
    )
