"""The in-jit sampler against exact numpy distributions: the support must be exactly
what top-k / top-p / min-p allow, and the empirical distribution must match."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.sampler import ProcessorState, SamplingArrays, apply_penalties, sample, top_logprobs
from jaxserve.scheduler_output import MAX_BANNED_TOKENS

VOCAB = 300
N = 20000


def rows(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, steps=None, banned=None):
    return SamplingArrays(
        temperature=jnp.full(n, temperature, jnp.float32),
        top_k=jnp.full(n, top_k, jnp.int32),
        top_p=jnp.full(n, top_p, jnp.float32),
        min_p=jnp.full(n, min_p, jnp.float32),
        seeds=jnp.arange(n, dtype=jnp.uint32) if seeds is None else jnp.asarray(seeds, jnp.uint32),
        steps=jnp.zeros(n, jnp.int32) if steps is None else jnp.asarray(steps, jnp.int32),
        banned=jnp.full((n, MAX_BANNED_TOKENS), -1, jnp.int32) if banned is None else jnp.asarray(banned),
        presence=jnp.zeros(n, jnp.float32),
        frequency=jnp.zeros(n, jnp.float32),
        repetition=jnp.ones(n, jnp.float32),
        processor_slot=jnp.full(n, -1, jnp.int32),
    )


def expected_distribution(logits, temperature, top_k, top_p, min_p):
    """vLLM's order: temperature, top-k, top-p over the renormalised top-k, then min-p."""
    scaled = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros(scaled.size, bool)
    keep[order[: top_k or scaled.size]] = True
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    if top_p < 1.0:
        sorted_p = probs[order]
        above = np.cumsum(sorted_p) - sorted_p
        nucleus = np.zeros(scaled.size, bool)
        nucleus[order[above < top_p]] = True
        probs = np.where(nucleus, probs, 0.0)
        probs /= probs.sum()
    if min_p > 0.0:
        probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


@pytest.fixture(scope="module")
def logits():
    return np.random.default_rng(0).normal(size=VOCAB).astype(np.float32) * 2.0


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 10, 1.0, 0.0), (1.0, 0, 0.5, 0.0), (1.3, 20, 0.8, 0.0), (1.0, 0, 1.0, 0.2)],
)
def test_distribution_matches_definition(logits, temperature, top_k, top_p, min_p):
    tokens, logprobs, _ = jax.jit(sample)(
        jnp.tile(jnp.asarray(logits), (N, 1)), rows(N, temperature, top_k, top_p, min_p)
    )
    tokens = np.asarray(tokens)
    want = expected_distribution(logits, temperature, top_k, top_p, min_p)
    seen = np.bincount(tokens, minlength=VOCAB) / N
    assert set(np.nonzero(seen)[0]) <= set(np.nonzero(want)[0])  # never outside the allowed set
    assert 0.5 * np.abs(seen - want).sum() < 0.04  # total variation, sampling noise ~0.01-0.03
    raw = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    np.testing.assert_allclose(np.asarray(logprobs), raw[tokens], atol=1e-5)


def test_greedy_rows_take_the_argmax_and_mix_with_random_rows(logits):
    batch = jnp.tile(jnp.asarray(logits), (4, 1))
    params = dataclasses.replace(rows(4), temperature=jnp.asarray([0.0, 1.0, 0.0, 1.0]))
    tokens, *_ = jax.jit(sample)(batch, params)
    assert int(tokens[0]) == int(tokens[2]) == int(np.argmax(logits))


def test_same_seed_and_step_same_token_regardless_of_row(logits):
    batch = jnp.tile(jnp.asarray(logits), (6, 1))
    tokens, *_ = jax.jit(sample)(batch, rows(6, seeds=[7, 1, 2, 7, 7, 3], steps=[0, 0, 0, 0, 1, 0]))
    t = np.asarray(tokens)
    assert t[0] == t[3]
    draws = jax.jit(sample)(
        jnp.tile(jnp.asarray(logits), (64, 1)), rows(64, seeds=[7] * 64, steps=range(64))
    )[0]
    assert len(set(np.asarray(draws).tolist())) > 10  # the step changes the draw


def test_banned_tokens_are_never_sampled_but_logprobs_stay_raw(logits):
    top = np.argsort(-logits)[:3].tolist()
    banned = np.full((2000, MAX_BANNED_TOKENS), -1, np.int32)
    banned[:, :3] = top
    batch = jnp.tile(jnp.asarray(logits), (2000, 1))
    params = dataclasses.replace(
        rows(2000, banned=banned), temperature=jnp.where(jnp.arange(2000) < 2, 0.0, 1.0)
    )
    tokens, logprobs, _ = jax.jit(sample)(batch, params)
    tokens = np.asarray(tokens)
    assert not set(tokens.tolist()) & set(top)
    assert tokens[0] == np.argsort(-logits)[3]  # greedy takes the best allowed token
    raw = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    np.testing.assert_allclose(np.asarray(logprobs), raw[tokens], atol=1e-5)


def numpy_penalties(logits, prompt_mask, counts, presence, frequency, repetition):
    """The definitions, row by row: repetition over prompt and output tokens (transformers'
    RepetitionPenaltyLogitsProcessor), frequency and presence over output tokens (OpenAI)."""
    out = np.array(logits, np.float64)
    for i in range(out.shape[0]):
        for t in range(out.shape[1]):
            if prompt_mask[i, t] or counts[i, t] > 0:
                out[i, t] = out[i, t] / repetition[i] if out[i, t] > 0 else out[i, t] * repetition[i]
            out[i, t] -= frequency[i] * counts[i, t] + presence[i] * (counts[i, t] > 0)
    return out


def test_penalties_match_their_definitions():
    rng = np.random.default_rng(0)
    n, vocab = 5, 40
    logits = rng.normal(size=(n, vocab)).astype(np.float32) * 3
    prompt_mask = rng.random((n, vocab)) < 0.2
    counts = rng.integers(0, 4, size=(n, vocab)) * (rng.random((n, vocab)) < 0.3)
    presence = np.asarray([0.0, 0.5, -1.0, 2.0, 0.3], np.float32)
    frequency = np.asarray([0.0, 0.2, 0.7, -0.5, 1.0], np.float32)
    repetition = np.asarray([1.0, 1.3, 0.8, 2.0, 1.1], np.float32)
    got = apply_penalties(
        jnp.asarray(logits),
        jnp.asarray(prompt_mask),
        jnp.asarray(counts, jnp.int32),
        jnp.asarray(presence),
        jnp.asarray(frequency),
        jnp.asarray(repetition),
    )
    want = numpy_penalties(logits, prompt_mask, counts, presence, frequency, repetition)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)
    assert not np.allclose(want[1:], logits[1:])  # the settings really move the logits


def test_slots_bias_penalise_and_count_only_their_own_rows(logits):
    """Rows 0 and 2 use slots 1 and 0 of the processor state, row 1 none: a bias that
    forces a token reaches only its row, the sampled tokens are counted in their slots,
    and the greedy choice follows the penalised logits."""
    num_slots, vocab = 3, logits.shape[0]
    best = int(np.argmax(logits))
    bias = np.zeros((num_slots, vocab), np.float32)
    bias[1, 7] = 1e4  # slot 1: token 7 always
    counts = np.zeros((num_slots, vocab), np.int32)
    counts[0, best] = 3  # slot 0 already produced the best token three times
    state = ProcessorState(jnp.zeros((num_slots, vocab), bool), jnp.asarray(counts), jnp.asarray(bias))
    params = dataclasses.replace(
        rows(3, temperature=0.0),
        frequency=jnp.asarray([0.0, 0.0, 100.0]),
        processor_slot=jnp.asarray([1, -1, 0], jnp.int32),
    )
    tokens, logprobs, _ = jax.jit(sample)(jnp.tile(jnp.asarray(logits), (3, 1)), params, state)
    tokens = np.asarray(tokens)
    assert tokens[0] == 7 and tokens[1] == best
    assert tokens[2] == np.argsort(-logits)[1]  # the best token penalised away
    raw = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    np.testing.assert_allclose(np.asarray(logprobs), raw[tokens], atol=1e-5)  # logprobs stay raw


def test_top_logprobs_and_ranks_match_a_sort():
    rng = np.random.default_rng(1)
    lps = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(4, 50)), jnp.float32), axis=-1)
    chosen = jnp.asarray([0, 10, 49, 3], jnp.int32)
    top = top_logprobs(lps, chosen, 5)
    order = np.argsort(-np.asarray(lps), axis=-1, kind="stable")
    np.testing.assert_array_equal(np.asarray(top.ids), order[:, :5])
    np.testing.assert_allclose(
        np.asarray(top.logprobs), np.take_along_axis(np.asarray(lps), order[:, :5], -1)
    )
    ranks = [1 + int(np.where(order[i] == c)[0][0]) for i, c in enumerate(np.asarray(chosen))]
    np.testing.assert_array_equal(np.asarray(top.chosen_ranks), ranks)
    np.testing.assert_array_equal(
        np.asarray(top.chosen_logprobs),
        np.take_along_axis(np.asarray(lps), np.asarray(chosen)[:, None], -1)[:, 0],
    )
