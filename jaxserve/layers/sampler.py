"""Token sampling inside the jitted step.

Every per-request setting arrives as a row of an array, so one compiled step serves any
mix of greedy and random rows, top-k/top-p/min-p values and seeds. The expensive part
(a sort over the vocabulary for top-k/top-p) runs only when some row asks for it.
Randomness comes from each row's own key, derived from (seed, step): a seeded request
samples the same tokens alone or inside any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    temperature: jax.Array  # [num_seqs] float32, 0 = greedy
    top_k: jax.Array  # [num_seqs] int32, 0 = off
    top_p: jax.Array  # [num_seqs] float32, 1 = off
    min_p: jax.Array  # [num_seqs] float32, 0 = off
    seeds: jax.Array  # [num_seqs] uint32
    steps: jax.Array  # [num_seqs] int32, index of the token being sampled


def _filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask logits outside each row's top-k, then outside the smallest set whose
    probability (renormalised over the top-k) reaches top-p, as vLLM does."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)  # [num_seqs, vocab]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranks = jnp.arange(vocab)[None, :]
    in_k = ranks < k[:, None]
    sorted_masked = jnp.where(in_k, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_masked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass strictly above each rank
    keep = in_k & (before < top_p[:, None])
    keep = keep.at[:, 0].set(True)
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1)  # [num_seqs]
    return jnp.where(logits >= threshold[:, None], logits, -jnp.inf)


def _apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    probs = jax.nn.softmax(logits, axis=-1)
    cutoff = min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs >= cutoff, logits, -jnp.inf)


def sample(
    logits: jax.Array,  # [num_seqs, vocab] float32
    params: SamplingArrays,
) -> tuple[jax.Array, jax.Array]:  # ([num_seqs] int32 tokens, [num_seqs] float32 logprobs)
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_greedy = params.temperature == 0.0

    def random_tokens() -> jax.Array:
        scaled = logits / jnp.where(is_greedy, 1.0, params.temperature)[:, None]
        needs_sort = jnp.any(~is_greedy & ((params.top_k > 0) | (params.top_p < 1.0)))
        scaled = jax.lax.cond(
            needs_sort, _filter_top_k_top_p, lambda x, *_: x, scaled, params.top_k, params.top_p
        )
        needs_min_p = jnp.any(~is_greedy & (params.min_p > 0.0))
        scaled = jax.lax.cond(needs_min_p, _apply_min_p, lambda x, _: x, scaled, params.min_p)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(params.seeds, params.steps)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
        return jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)

    sampled = jax.lax.cond(jnp.all(is_greedy), lambda: greedy_tokens, random_tokens)
    tokens = jnp.where(is_greedy, greedy_tokens, sampled)
    token_logprobs = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, token_logprobs
