"""Request bodies of the pooling endpoints: POST /v1/embeddings (OpenAI's, plus vLLM's extras) and
POST /pooling (vLLM's), validated with pydantic like protocol.py's, and the vector's encoding.

An input is one text, several, one token-id list or several; or, instead, `messages`, which the
model's chat template turns into one prompt (vLLM's chat form of the same endpoints).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import Field

from jaxserve.entrypoints.openai.protocol import (
    ChatMessage,
    OpenAIBaseModel,
    bad_request,
    prompt_list,
)
from jaxserve.pooling_params import PoolingParams


class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = Field(None, union_mode="left_to_right")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None
    normalize: bool | None = None
    # the chat form: a conversation through the chat template instead of `input`
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def prompts(self) -> list[str | list[int]]:
        """`input` as a list of prompts (text or token ids)."""
        if (self.input is None) == (self.messages is None):
            raise bad_request("Give either `input` or `messages`.", "input")
        return prompt_list(self.input, "input")

    def to_pooling_params(self, task: str) -> PoolingParams:
        return PoolingParams(
            dimensions=self.dimensions,
            normalize=self.normalize,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            task=task,
        )


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the same fields; the answer carries the pooled vector as `data` (a reward
    model's: a row per token or step). `use_activation`: a classifier's or reward model's
    probabilities (true) or logits (false); the model's pooler decides when absent."""

    use_activation: bool | None = None

    def to_pooling_params(self, task: str) -> PoolingParams:
        return super().to_pooling_params(task).clone(use_activation=self.use_activation)


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """The vector as JSON numbers, or as OpenAI's base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return np.asarray(vector, np.float32).tolist()


class ClassificationRequest(EmbeddingRequest):
    """vLLM's /classify: the same inputs; each answer carries the class probabilities."""

    def to_pooling_params(self, task: str) -> PoolingParams:
        if self.dimensions is not None or self.normalize is not None:
            raise bad_request("dimensions and normalize apply to embeddings, not to /classify.", "dimensions")
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens, task=task)


class CohereEmbedRequest(OpenAIBaseModel):
    """Cohere's POST /v2/embed: `texts`, the encodings wanted (`embedding_types`: float, base64), and
    where an over-long text is cut (`truncate`: END drops its end, START its start, NONE refuses it)."""

    model: str | None = None
    texts: list[str] = Field(min_length=1)
    input_type: str | None = None  # Cohere's hint for its own models (search_query, ...): no effect here
    embedding_types: list[Literal["float", "base64"]] = Field(default_factory=lambda: ["float"], min_length=1)
    truncate: Literal["NONE", "START", "END"] = "END"
    output_dimension: int | None = None
    priority: int = 0
    request_id: str | None = None

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(
            dimensions=self.output_dimension,
            truncate_prompt_tokens=-1 if self.truncate == "START" else None,
            task="embed",
        )
