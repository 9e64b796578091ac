"""Dense families beyond plain Llama (Mistral with a sliding window, Phi-3, Qwen2, Qwen3)
against transformers on the same weights (float32): logits at every prompt position, and
32 greedy steps over a batch of mixed-length prompts."""

from __future__ import annotations

from reference_checks import assert_greedy_batch_matches, assert_logits_match_at_every_position


def test_logits_match_transformers_at_every_position(tiny_family):
    assert_logits_match_at_every_position(*tiny_family)


def test_greedy_batch_matches_transformers(tiny_family):
    assert_greedy_batch_matches(*tiny_family)
