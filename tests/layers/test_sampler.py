"""The in-jit sampler against exact numpy distributions: the support must be exactly
what top-k / top-p / min-p allow, and the empirical distribution must match."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.sampler import SamplingArrays, sample
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
    tokens, logprobs = jax.jit(sample)(
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
    tokens, _ = jax.jit(sample)(batch, params)
    assert int(tokens[0]) == int(tokens[2]) == int(np.argmax(logits))


def test_same_seed_and_step_same_token_regardless_of_row(logits):
    batch = jnp.tile(jnp.asarray(logits), (6, 1))
    tokens, _ = jax.jit(sample)(batch, rows(6, seeds=[7, 1, 2, 7, 7, 3], steps=[0, 0, 0, 0, 1, 0]))
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
    tokens, logprobs = jax.jit(sample)(batch, params)
    tokens = np.asarray(tokens)
    assert not set(tokens.tolist()) & set(top)
    assert tokens[0] == np.argsort(-logits)[3]  # greedy takes the best allowed token
    raw = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    np.testing.assert_allclose(np.asarray(logprobs), raw[tokens], atol=1e-5)
