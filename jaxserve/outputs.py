"""vLLM-shaped results: RequestOutput holding one CompletionOutput per sample; PoolingRequestOutput
holding a pooling request's vector."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Logprob:
    """One candidate token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob; the chosen token first, then the top-k.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, later: CompletionOutput) -> None:
        """Append a later delta of the same sample (output_kind DELTA)."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *later.logprobs]
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None for a prompt given as embeddings (vLLM: the same)
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # set when the engine failed while running the request

    def add(self, later: RequestOutput) -> None:
        """Merge a later delta of the same request into this one (output_kind DELTA): what a
        reader that fell behind gets, as one output, instead of every step's."""
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            if c.index in mine:
                mine[c.index].add(c)
            else:
                self.outputs.append(c)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.error = later.error
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs


@dataclass
class PoolingOutput:
    """A pooling request's result: its vector (an embedding) as float32 numbers."""

    data: np.ndarray


@dataclass
class EmbeddingOutput:
    """What LLM.embed returns per prompt (vLLM's): the embedding as a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """What LLM.classify returns per prompt (vLLM's): the probability of each class."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """What LLM.score returns per pair (vLLM's): how similar the two texts are."""

    score: float


@dataclass
class PoolingRequestOutput:
    """vLLM's PoolingRequestOutput: one pooling request's result (`outputs`: a PoolingOutput, an
    EmbeddingOutput from LLM.embed, a ClassificationOutput from LLM.classify, a ScoringOutput from
    LLM.score)."""

    request_id: str
    outputs: PoolingOutput | EmbeddingOutput | ClassificationOutput | ScoringOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed while running the request

    def as_embedding(self) -> PoolingRequestOutput:
        """The same result with its vector as an EmbeddingOutput (vLLM's EmbeddingRequestOutput)."""
        data = self.outputs.data if isinstance(self.outputs, PoolingOutput) else self.outputs.embedding
        return dataclasses.replace(self, outputs=EmbeddingOutput(np.asarray(data).tolist()))

    def as_classification(self) -> PoolingRequestOutput:
        """The same result with its probabilities as a ClassificationOutput."""
        return dataclasses.replace(self, outputs=ClassificationOutput(np.asarray(self.outputs.data).tolist()))


# vLLM's names for LLM.embed's, LLM.classify's and LLM.score's outputs
EmbeddingRequestOutput = ClassificationRequestOutput = ScoringRequestOutput = PoolingRequestOutput
