"""What every model family gives the step: hidden states over a ragged token batch, then logits
at whichever rows need them.

The two halves are separate so that the step decides where the vocabulary-sized work happens:
logits at the sampled rows only, or, for prompt logprobs, at every fed token a chunk at a time
(runner/step.py); `__call__` joins them for callers that want logits at some rows in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.layers.attention import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class InputEmbeds:
    """Rows fed to the layers in place of the embedding module's: a prompt given as embeddings
    (jaxserve/prompt_embeds.py). They replace what transformers' embedding module gives (Gemma's
    rows already scaled by it) and go through what its model does with inputs_embeds after that
    (OPT's projection in and learned positions, GPT-2's positions)."""

    rows: jax.Array  # [num_tokens, embedding width] float32
    mask: jax.Array  # [num_tokens] int32: 1 where a row replaces the table's

    def over(self, x: jax.Array) -> jax.Array:
        return jnp.where(self.mask[:, None] > 0, self.rows.astype(x.dtype), x)


class CausalLM(nnx.Module):
    """A decoder: `hidden_states` runs the layers (writing the batch's KV into the pool),
    `compute_logits` the final norm (`final_hidden`) and the head."""

    def __call__(
        self,
        input_ids: jax.Array,  # [num_tokens] int32
        positions: jax.Array,  # [num_tokens] int32
        kv_pool: jax.Array,  # [num_layers * pages_per_layer, 2 * num_kv_heads, page_size, head_dim]
        meta: AttentionMetadata,
        logits_indices: jax.Array,  # [num_logits] int32, rows of the batch to compute logits for
        lora_slots: jax.Array | None = None,  # [num_tokens] int32, each token's LoRA slot (-1: none)
    ) -> tuple[jax.Array, jax.Array]:  # ([num_logits, vocab] float32, kv_pool)
        x, kv_pool = self.hidden_states(input_ids, positions, kv_pool, meta, lora_slots)
        return self.compute_logits(x[logits_indices]), kv_pool

    def hidden_states(
        self,
        input_ids: jax.Array,  # [num_tokens] int32
        positions: jax.Array,  # [num_tokens] int32
        kv_pool: jax.Array,  # [num_layers * pages_per_layer, 2 * num_kv_heads, page_size, head_dim]
        meta: AttentionMetadata,
        lora_slots: jax.Array | None = None,  # [num_tokens] int32, each token's LoRA slot (-1: none)
        input_embeds: InputEmbeds | None = None,  # rows fed in place of the embedding table's
        rope_positions: jax.Array | None = None,  # [3, num_tokens] int32, M-RoPE models only
    ) -> tuple[jax.Array, jax.Array]:  # ([num_tokens, hidden], before the final norm; kv_pool)
        raise NotImplementedError

    def final_hidden(self, x: jax.Array) -> jax.Array:
        """[rows, hidden]: hidden_states' rows after the final norm (and any projection out): what
        the head reads, and what a pooling model pools (transformers' last_hidden_state)."""
        raise NotImplementedError

    def pooler_head(self, x: jax.Array) -> jax.Array:
        """A pooling model's pooled rows [rows, hidden] float32 through its head: a classifier's score
        projection ([rows, num_labels]; linear and without bias, so it applies to sums of rows as
        to rows), nothing for an embedding model."""
        return x

    def compute_logits(self, x: jax.Array) -> jax.Array:
        """[rows, vocab] float32 logits of hidden states [rows, hidden] (hidden_states' rows)."""
        raise NotImplementedError
