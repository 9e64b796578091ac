"""Request bodies of the scoring endpoints: POST /score (vLLM's: text_1 against text_2, one to one,
one to many or pairwise) and POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape: a
query against documents, best first), validated with pydantic like protocol.py's."""

from __future__ import annotations

from pydantic import Field

from jaxserve.entrypoints.openai.protocol import MAX_PROMPTS_PER_REQUEST, OpenAIBaseModel, bad_request
from jaxserve.pooling_params import score_pairs


class ScoreRequest(OpenAIBaseModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = 0
    request_id: str | None = None

    def pairs(self) -> list[tuple[str, str]]:
        """(text_1, text_2) of each score: one text against one or many, or two lists pairwise."""
        try:
            pairs = score_pairs(self.text_1, self.text_2)
        except ValueError as e:
            raise bad_request(str(e), "text_2") from None
        if len(pairs) > MAX_PROMPTS_PER_REQUEST:
            raise bad_request(f"One request may score at most {MAX_PROMPTS_PER_REQUEST} pairs.", "text_2")
        return pairs


class RerankRequest(OpenAIBaseModel):
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)
    top_n: int = Field(0, ge=0)  # 0: all of them
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = 0
    request_id: str | None = None
