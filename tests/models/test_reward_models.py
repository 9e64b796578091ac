"""Reward models against a reference: Qwen2ForRewardModel (a reward per token) and
Qwen2ForProcessRewardModel (two labels per reasoning step, STEP pooling at a step tag token) as
their published checkpoints' own code computes them (transformers' Qwen2 layers, then their head
in float64), and a generative checkpoint served as a process reward model from its LM head's
logits (vLLM's --convert reward with returned_token_ids, math-shepherd's recipe); through chunks,
and refused for the tasks they do not serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import engine_kwargs, make_family_checkpoint, make_reward_model

from jaxserve import LLM
from jaxserve.pooling_params import PoolingParams

PROMPTS = [
    "Step one: the quick brown fox. Step two: jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany. " * 3,
    "hi",
]


def hidden_states(base, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return base(torch.tensor([ids])).last_hidden_state[0].double().numpy()


def reward_reference(base, head, ids: list[int]) -> np.ndarray:
    """[tokens, labels]: the reward head over each token's final hidden state."""
    w0, b0, w2, b2 = head
    return np.maximum(hidden_states(base, ids) @ w0.T + b0, 0.0) @ w2.T + b2


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def outcome_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_rm")
    return str(path), *make_reward_model(path)


@pytest.fixture(scope="module")
def process_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_prm")
    return str(path), *make_reward_model(path, process=True)


def test_a_reward_per_token(outcome_model):
    """Qwen2ForRewardModel: served for rewards by its architecture alone, every token's reward
    (ALL), through chunks of 16 tokens; no activation over a single label."""
    path, base, head = outcome_model
    llm = LLM(path, **engine_kwargs(max_num_batched_tokens=16))
    tok = llm.get_tokenizer()
    outs = llm.reward(PROMPTS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids and out.outputs.data.shape == (len(ids), 1)
        np.testing.assert_allclose(out.outputs.data, reward_reference(base, head, ids), rtol=1e-4, atol=1e-4)
    (encoded,) = llm.encode(PROMPTS[0], use_tqdm=False)  # /pooling's task: the same rows
    np.testing.assert_array_equal(encoded.outputs.data, outs[0].outputs.data)
    for call, message in [
        (llm.embed, "served for rewards; embeddings need an embedding model"),
        (llm.classify, "served for rewards; classification needs"),
    ]:
        with pytest.raises(ValueError, match=message):
            call(PROMPTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="served for rewards; scores need"):
        llm.score(PROMPTS[0], PROMPTS[1], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions and normalize apply to embeddings"):
        llm.reward(PROMPTS[0], PoolingParams(normalize=True), use_tqdm=False)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_process_reward_model_scores_each_step(process_model, async_scheduling):
    """Qwen2ForProcessRewardModel: STEP pooling keeps the rows at the step tag token, each the
    softmax of its two labels; use_activation=False gives the logits; with pooling_type ALL every
    token's row."""
    path, base, head = process_model
    kw = engine_kwargs(max_num_batched_tokens=16, async_scheduling=async_scheduling)
    probe = LLM(path, **kw)
    tok = probe.get_tokenizer()
    tag = tok.encode(".")[0]
    del probe
    llm = LLM(path, pooler_config={"step_tag_id": tag}, **kw)
    for prompt, out, raw in zip(
        PROMPTS,
        llm.reward(PROMPTS, use_tqdm=False),
        llm.reward(PROMPTS, PoolingParams(use_activation=False), use_tqdm=False),
    ):
        ids = tok.encode(prompt)
        logits = reward_reference(base, head, ids)[np.asarray(ids) == tag]
        assert out.outputs.data.shape == (prompt.count("."), 2)
        np.testing.assert_allclose(out.outputs.data, softmax(logits), atol=1e-5)
        np.testing.assert_allclose(raw.outputs.data, logits, rtol=1e-4, atol=1e-4)
    every = LLM(path, pooler_config={"pooling_type": "ALL"}, **kw)
    ids = tok.encode(PROMPTS[0])
    (out,) = every.reward(PROMPTS[0], use_tqdm=False)
    np.testing.assert_allclose(out.outputs.data, softmax(reward_reference(base, head, ids)), atol=1e-5)


def test_a_generative_model_as_a_process_reward_model(tmp_path):
    """--convert reward with STEP, step_tag_id and returned_token_ids (math-shepherd's recipe): at
    each step tag, the softmax of the LM head's logits of the returned tokens; without a pooler
    config, --convert reward gives every token's final hidden state."""
    causal = make_family_checkpoint(tmp_path, "qwen3")
    llm = LLM(str(tmp_path), convert="reward", **engine_kwargs())
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    for i, out in zip(ids, llm.reward(PROMPTS, use_tqdm=False)):
        np.testing.assert_allclose(out.outputs.data, hidden_states(causal.model, i), rtol=1e-4, atol=1e-4)
    tag, plus, minus = tok.encode("."), tok.encode(" the"), tok.encode(" of")
    config = {"pooling_type": "STEP", "step_tag_id": tag[0], "returned_token_ids": [plus[0], minus[0]]}
    llm = LLM(str(tmp_path), convert="reward", pooler_config=config, **engine_kwargs())
    for i, out in zip(ids, llm.reward(PROMPTS, use_tqdm=False)):
        with torch.no_grad():
            logits = causal(torch.tensor([i])).logits[0].double().numpy()
        want = softmax(logits[np.asarray(i) == tag[0]][:, [plus[0], minus[0]]])
        assert out.outputs.data.shape == want.shape
        np.testing.assert_allclose(out.outputs.data, want, atol=1e-5)
