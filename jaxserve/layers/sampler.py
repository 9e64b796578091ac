"""Token sampling inside the jitted step.

Every per-request setting arrives as a row of an array, so one compiled step serves any
mix of greedy and random rows, top-k/top-p/min-p values and seeds. Randomness comes from
each row's own key, derived from (seed, step): a seeded request samples the same tokens
alone or inside any batch.

Sampling is exact and avoids the two things that are slow on XLA:CPU, a sort over the
vocabulary and a random number per vocabulary entry:
- top-k and top-p thresholds are found by bisection over the float bit patterns (32
  passes of compare-and-sum, exact), and only when some row asks for them;
- the categorical draw is two-level: pick a block of the vocabulary by its probability
  mass, then a token inside it, with two uniforms per row.

Logit processing (vLLM's order): logit bias, allowed tokens and single-token bad words
(one dense bias row per request), then the masked ids of the step (EOS and stop ids under
min_tokens, the last token of a multi-token bad word whose prefix was just generated),
then the repetition, frequency and presence penalties, then temperature, top-k/top-p and
min-p. Bias rows and token history live on the device in a ProcessorState, one slot per
request that uses them; the step counts each sampled token there in place.

Logprobs are of the raw distribution (vLLM's default `raw_logprobs`): the sampled token's,
and on request the top-k ids and values and the sampled token's rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.scheduler_output import TopLogprobs

_BLOCK = 256  # vocabulary block of the two-level categorical draw


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    temperature: jax.Array  # [num_seqs] float32, 0 = greedy
    top_k: jax.Array  # [num_seqs] int32, 0 = off
    top_p: jax.Array  # [num_seqs] float32, 1 = off
    min_p: jax.Array  # [num_seqs] float32, 0 = off
    seeds: jax.Array  # [num_seqs] uint32
    steps: jax.Array  # [num_seqs] int32, index of the token being sampled
    banned: jax.Array  # [num_seqs, MAX_BANNED_TOKENS] int32 token ids to mask, -1 = none
    presence: jax.Array  # [num_seqs] float32, 0 = off
    frequency: jax.Array  # [num_seqs] float32, 0 = off
    repetition: jax.Array  # [num_seqs] float32, 1 = off
    processor_slot: jax.Array  # [num_seqs] int32, the row's ProcessorState row; -1 = none


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ProcessorState:
    """Per-request logit-processing state on the device, one row per slot."""

    prompt_mask: jax.Array  # [num_slots, vocab] bool, token occurs in the prompt
    output_counts: jax.Array  # [num_slots, vocab] int32, times the token was sampled
    bias: jax.Array  # [num_slots, vocab] float32, added to the logits (-inf: never)


def apply_penalties(
    logits: jax.Array,  # [num_seqs, vocab] float32
    prompt_mask: jax.Array,  # [num_seqs, vocab] bool
    output_counts: jax.Array,  # [num_seqs, vocab] int32
    presence: jax.Array,  # [num_seqs]
    frequency: jax.Array,  # [num_seqs]
    repetition: jax.Array,  # [num_seqs]
) -> jax.Array:
    """vLLM's (and transformers') penalties: repetition over prompt and output tokens
    (positive logits divided, negative multiplied); frequency and presence over output
    tokens, subtracted (OpenAI's definition)."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = output_counts.astype(jnp.float32)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def process_logits(
    logits: jax.Array,
    params: SamplingArrays,
    state: ProcessorState | None,
    extra_counts: jax.Array | None = None,  # [num_seqs, vocab] int32, outputs the state has not counted yet
) -> jax.Array:  # [num_seqs, vocab] float32
    """Bias rows, the step's masked ids and the penalties, as the module docstring orders them."""
    has_slot = params.processor_slot >= 0
    slot = jnp.where(has_slot, params.processor_slot, 0)
    if state is not None:
        logits = logits + jnp.where(has_slot[:, None], state.bias[slot], 0.0)
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], params.banned.shape)
    banned = jnp.where(params.banned >= 0, params.banned, logits.shape[1])  # -1 -> dropped
    logits = logits.at[rows, banned].set(-jnp.inf, mode="drop")
    if state is not None:
        counts = state.output_counts[slot]
        penalised = apply_penalties(
            logits,
            state.prompt_mask[slot],
            counts if extra_counts is None else counts + extra_counts,
            params.presence,
            params.frequency,
            params.repetition,
        )
        logits = jnp.where(has_slot[:, None], penalised, logits)
    return logits


def count_sampled(state: ProcessorState, slot: jax.Array, tokens: jax.Array) -> ProcessorState:
    """Add each sampled token to its row's output counts (rows without a slot: dropped)."""
    slot = jnp.where(slot >= 0, slot, state.output_counts.shape[0])
    counts = state.output_counts.at[slot, tokens].add(1, mode="drop")
    return ProcessorState(state.prompt_mask, counts, state.bias)


def top_logprobs(logprobs: jax.Array, chosen: jax.Array, k: int) -> TopLogprobs[jax.Array]:
    """The k most likely tokens of each row of `logprobs` [num_rows, vocab], and the logprob
    and rank of the `chosen` [num_rows] token."""
    values, ids = jax.lax.top_k(logprobs, k)
    chosen_lp = jnp.take_along_axis(logprobs, chosen[:, None], axis=-1)  # [num_rows, 1]
    rank = 1 + jnp.sum(logprobs > chosen_lp, axis=-1)
    return TopLogprobs(ids.astype(jnp.int32), values, chosen_lp[:, 0], rank.astype(jnp.int32))


def _sortable(x: jax.Array) -> jax.Array:
    """int32 keys that order like the float32 values (-inf lowest)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _bisect_max_key(ok, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Per row, the largest int32 key t in [lo, hi] with ok(t) true, assuming ok(lo) holds
    and ok is monotone (true up to some key, false above)."""

    def body(_, bounds):
        lo, hi = bounds
        # Ceiling of the mean without int32 overflow: lo < mid <= hi while lo < hi.
        mid = (lo & hi) + ((lo ^ hi) >> 1) + ((lo ^ hi) & 1)
        good = ok(mid) | (lo >= hi)
        return jnp.where(good, jnp.maximum(mid, lo), lo), jnp.where(good, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return lo


def _top_k_top_p_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep each row's top-k logits, then the smallest top set of the renormalised
    distribution whose mass reaches top-p (vLLM's order). Ties at a threshold are kept."""
    vocab = logits.shape[-1]
    keys = _sortable(logits)  # [num_seqs, vocab]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    lo, hi = jnp.min(keys, -1, keepdims=True), jnp.max(keys, -1, keepdims=True)
    kth = _bisect_max_key(lambda t: jnp.sum(keys >= t, -1, keepdims=True) >= k, lo, hi)
    logits = jnp.where(keys >= kth, logits, -jnp.inf)

    probs = jax.nn.softmax(logits, axis=-1)
    pkeys = _sortable(probs)
    p = top_p[:, None]
    lo, hi = jnp.zeros_like(lo), jnp.max(pkeys, -1, keepdims=True)
    # Largest probability threshold whose kept mass still reaches top_p.
    cut = _bisect_max_key(
        lambda t: jnp.sum(jnp.where(pkeys >= t, probs, 0.0), -1, keepdims=True) >= p, lo, hi
    )
    return jnp.where(pkeys >= cut, logits, -jnp.inf)


def _apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    probs = jax.nn.softmax(logits, axis=-1)
    cutoff = min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs >= cutoff, logits, -jnp.inf)


def _first_above(cumsum: jax.Array, x: jax.Array, weights: jax.Array) -> jax.Array:
    """Index of the first entry whose running sum exceeds x, never one of zero weight."""
    idx = jnp.sum(cumsum <= x[:, None], axis=-1)
    positions = jnp.arange(weights.shape[-1])
    last_nonzero = jnp.max(jnp.where(weights > 0, positions, 0), axis=-1)
    return jnp.minimum(idx, last_nonzero)


def _categorical(logits: jax.Array, uniforms: jax.Array) -> jax.Array:
    """Exact draw from softmax(logits) per row with two uniforms: a vocabulary block by
    mass, then a token inside the block."""
    num_seqs, vocab = logits.shape
    pad = -vocab % _BLOCK
    weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    weights = jnp.pad(weights, ((0, 0), (0, pad))).reshape(num_seqs, -1, _BLOCK)
    block_mass = jnp.sum(weights, axis=-1)  # [num_seqs, num_blocks]
    cum = jnp.cumsum(block_mass, axis=-1)
    block = _first_above(cum, uniforms[:, 0] * cum[:, -1], block_mass)
    inner_w = jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0]  # [num_seqs, _BLOCK]
    inner_cum = jnp.cumsum(inner_w, axis=-1)
    inner = _first_above(inner_cum, uniforms[:, 1] * inner_cum[:, -1], inner_w)
    return (block * _BLOCK + inner).astype(jnp.int32)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where a row's packed mask ([rows, ceil(vocab / 32)] int32, bit t % 32 of word t // 32)
    has the token's bit clear: structured outputs' allowed tokens."""
    vocab = logits.shape[-1]
    ids = jnp.arange(vocab, dtype=jnp.int32)
    words = jnp.take(bitmask, ids // 32, axis=1)
    allowed = ((words >> (ids % 32)) & 1).astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def sample(
    logits: jax.Array,  # [num_seqs, vocab] float32
    params: SamplingArrays,
    state: ProcessorState | None = None,  # given: bias rows and penalties apply
    num_top_logprobs: int = 0,  # > 0: also the top-k raw logprobs and the chosen token's rank
    extra_counts: jax.Array | None = None,  # outputs to penalise besides the state's (process_logits)
) -> tuple[jax.Array, jax.Array, TopLogprobs[jax.Array] | None]:
    """Returns ([num_seqs] int32 tokens, [num_seqs] float32 raw logprobs of them, top-k)."""
    logits = logits.astype(jnp.float32)
    raw_logits = logits
    logits = process_logits(logits, params, state, extra_counts)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_greedy = params.temperature == 0.0

    def random_tokens() -> jax.Array:
        scaled = logits / jnp.where(is_greedy, 1.0, params.temperature)[:, None]
        needs_k_p = jnp.any(~is_greedy & ((params.top_k > 0) | (params.top_p < 1.0)))
        scaled = jax.lax.cond(
            needs_k_p, _top_k_top_p_mask, lambda x, *_: x, scaled, params.top_k, params.top_p
        )
        needs_min_p = jnp.any(~is_greedy & (params.min_p > 0.0))
        scaled = jax.lax.cond(needs_min_p, _apply_min_p, lambda x, _: x, scaled, params.min_p)
        uniforms = jax.vmap(lambda s, i: jax.random.uniform(jax.random.fold_in(jax.random.key(s), i), (2,)))(
            params.seeds, params.steps
        )
        return _categorical(scaled, uniforms)

    sampled = jax.lax.cond(jnp.all(is_greedy), lambda: greedy_tokens, random_tokens)
    tokens = jnp.where(is_greedy, greedy_tokens, sampled)
    raw_logprobs = jax.nn.log_softmax(raw_logits, axis=-1)
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    top = top_logprobs(raw_logprobs, tokens, num_top_logprobs) if num_top_logprobs else None
    return tokens, chosen, top
