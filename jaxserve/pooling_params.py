"""Per-request pooling settings (vLLM's PoolingParams), and what a pooled vector becomes.

A pooling request (an embedding) is run as a prompt and nothing else: the step hands back, for
each row it fed, the sum of the row's final hidden states and those at its first and last token
(runner/step.py, the pool kind); the Scheduler adds a prompt's chunks up on the request
(`PooledSums`), and when the last chunk is back the engine turns them into the request's vector
here: the pooler's reduction (LAST, MEAN, CLS), then `dimensions` (Matryoshka) and `normalize`
for an embedding, or a classifier's activation over its score head's logits. ALL and STEP keep
every token's row (through the model's head: a reward model's per-token rewards); STEP then keeps
the rows at its step tag token (a process reward model's score per reasoning step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

# --pooler-config pooling types jaxserve computes (vLLM's names).
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL", "STEP")
# those that keep a row per token (the step's pool_all kind)
TOKENWISE_TYPES = ("ALL", "STEP")
# Pooling tasks a request may name (vLLM's): an embedding model serves embed, a classifier classify,
# a reward model reward (LLM.reward); all serve encode (the pooled output as it is); embedding models
# and cross-encoders serve score (pairs of texts compared).
POOLING_TASKS = ("embed", "classify", "reward", "encode", "score")


@dataclass
class PoolingParams:
    """vLLM's PoolingParams: `dimensions` keeps the first d numbers of the embedding (models
    trained for it: Matryoshka), `normalize` scales it to length 1 (None: the model's pooler
    decides), `truncate_prompt_tokens` keeps the prompt's last k tokens (-1: as many as the model
    takes)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    # a classifier's probabilities (softmax; sigmoid for one label) rather than its logits (None:
    # the model's pooler decides); vLLM's use_activation
    use_activation: bool | None = None
    task: str | None = None  # one of POOLING_TASKS; None: whatever the model serves

    def clone(self, **changes) -> PoolingParams:
        return dataclasses.replace(self, **changes)


class PooledSums:
    """A pooling request's step results so far (one per prompt chunk): the sum of its tokens' final
    hidden states, the first token's and the last token's. A chunk that starts the prompt again
    (a preempted request recomputing it) starts them over."""

    def __init__(self) -> None:
        self.total: np.ndarray | None = None
        self.first: np.ndarray | None = None
        self.last: np.ndarray | None = None
        self.tokens: list[np.ndarray] = []  # ALL pooling: each chunk's tokens' rows

    def add(self, row: np.ndarray, starts: bool, ends: bool, tokens: np.ndarray | None = None) -> None:
        """row: [3, hidden] float32, the step's (sum, first, last) of one chunk; tokens: its
        [chunk tokens, hidden] rows (ALL pooling)."""
        if starts or self.total is None:
            self.total, self.first, self.tokens = row[0].copy(), row[1], []
        else:
            self.total += row[0]
        if ends:
            self.last = row[2]
        if tokens is not None:
            self.tokens.append(tokens)

    def vector(self, pooling_type: str, num_tokens: int) -> np.ndarray:
        """[hidden] (ALL, STEP: [num_tokens, hidden])."""
        if pooling_type in TOKENWISE_TYPES:
            return np.concatenate(self.tokens)
        if pooling_type == "MEAN":
            return self.total / num_tokens
        return self.first if pooling_type == "CLS" else self.last


def finish_embedding(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """vLLM's order: the first `dimensions` numbers, then scaled to length 1 (each token's row of
    an ALL pooling)."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    if normalize:
        vector = vector / np.maximum(np.linalg.norm(vector, axis=-1, keepdims=True), 1e-12)
    return vector.astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine similarity of two vectors (what scoring and reranking with an embedding model give)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))


def finish_classification(logits: np.ndarray, activation: bool) -> np.ndarray:
    """A classifier's logits as probabilities (softmax; sigmoid for a single label, a
    cross-encoder's score), or as they are."""
    logits = np.asarray(logits, np.float64)
    if not activation:
        return logits.astype(np.float32)
    if logits.shape[-1] == 1:
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    e = np.exp(logits - logits.max())
    return (e / e.sum()).astype(np.float32)


def finish_reward(
    rows: np.ndarray, token_ids, step_tag_id: int | None, columns: tuple[int, ...], activation: bool
) -> np.ndarray:
    """A reward model's per-token rows [tokens, labels] as vLLM's STEP pooler leaves them: the
    `columns` kept (returned_token_ids), then only the rows at the step tag token (None: every
    row), then a softmax over each row's labels when `activation`."""
    if columns:
        rows = rows[:, list(columns)]
    if step_tag_id is not None:
        rows = rows[np.asarray(token_ids) == step_tag_id]
    if activation:
        rows = np.exp(rows - rows.max(axis=-1, keepdims=True))
        rows = rows / rows.sum(axis=-1, keepdims=True)
    return rows.astype(np.float32)


def score_pairs(first: str | list[str], second: str | list[str]) -> list[tuple[str, str]]:
    """The (first, second) texts scored: one text against each of several, or two lists pairwise;
    ValueError (naming vLLM's text_1 / text_2) otherwise."""
    first = [first] if isinstance(first, str) else list(first)
    second = [second] if isinstance(second, str) else list(second)
    if not first or not second:
        raise ValueError("text_1 and text_2 must not be empty.")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(
            f"text_1 holds {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as text_2."
        )
    return list(zip(first, second))


def is_cross_encoder(pooler) -> bool:
    """A pooling model scores pairs by reading them together: a classifier (config.PoolerConfig
    task classify), which must have a single label (its sigmoid is the score). An embedding model
    compares the two texts' embeddings instead."""
    if pooler is not None and pooler.task == "reward":
        raise ValueError(
            "This model is served for rewards; scores need an embedding model or a cross-encoder."
        )
    if pooler is None or pooler.task != "classify":
        return False
    if len(pooler.labels) != 1:
        raise ValueError(
            f"Scoring pairs with a classifier needs a cross-encoder (one label); this one has {len(pooler.labels)}."
        )
    return True


def pair_prompt(tokenizer, first: str, second: str) -> dict:
    """Two texts as one prompt, as the tokenizer joins a pair (BERT: [CLS] a [SEP] b [SEP])."""
    if tokenizer is None:
        raise ValueError("Scoring text pairs needs a tokenizer (skip_tokenizer_init is set).")
    return {"prompt": None, "prompt_token_ids": list(tokenizer(first, second)["input_ids"])}
