"""Per-request pooling settings (vLLM's PoolingParams), and what a pooled vector becomes.

A pooling request (an embedding) is run as a prompt and nothing else: the step hands back, for
each row it fed, the sum of the row's final hidden states and those at its first and last token
(runner/step.py, the pool kind); the Scheduler adds a prompt's chunks up on the request
(`PooledSums`), and when the last chunk is back the engine turns them into the request's vector
here: the pooler's reduction (LAST, MEAN, CLS), then `dimensions` (Matryoshka) and `normalize`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

# --pooler-config pooling types jaxserve computes (vLLM's names).
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# Pooling tasks a request may name (vLLM's): what an embedding model serves.
POOLING_TASKS = ("embed", "encode")


@dataclass
class PoolingParams:
    """vLLM's PoolingParams: `dimensions` keeps the first d numbers of the embedding (models
    trained for it: Matryoshka), `normalize` scales it to length 1 (None: the model's pooler
    decides), `truncate_prompt_tokens` keeps the prompt's last k tokens (-1: as many as the model
    takes)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None  # "embed" or "encode"; None: the caller's (LLM.embed, the endpoint)

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

    def add(self, row: np.ndarray, starts: bool, ends: bool) -> None:
        """row: [3, hidden] float32, the step's (sum, first, last) of one chunk."""
        if starts or self.total is None:
            self.total, self.first = row[0].copy(), row[1]
        else:
            self.total += row[0]
        if ends:
            self.last = row[2]

    def vector(self, pooling_type: str, num_tokens: int) -> np.ndarray:
        if pooling_type == "MEAN":
            return self.total / num_tokens
        return self.first if pooling_type == "CLS" else self.last


def finish_embedding(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """vLLM's order: the first `dimensions` numbers, then scaled to length 1."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine similarity of two vectors (what scoring and reranking with an embedding model give)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))
