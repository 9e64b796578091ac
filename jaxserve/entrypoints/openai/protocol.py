"""Request bodies of the OpenAI API (plus vLLM's extra fields), validated with pydantic,
and the error body every failure answers with.

Where it sits: first thing a handler does is `CompletionRequest.model_validate(json)`;
a ValidationError becomes a 400 naming the field. `to_sampling_params` is the one place
request fields become a SamplingParams: unset fields take the model's generation-config
defaults, then vLLM's.
"""

from __future__ import annotations

import time
import uuid
from http import HTTPStatus
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from jaxserve.beam_search import BeamSearchParams
from jaxserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

_INT64 = 2**63 - 1
# OpenAI clamps each logit_bias value into this range.
_LOGIT_BIAS_LIMIT = 100.0


def bad_request(message: str, param: str | None = None) -> ValueError:
    """A ValueError (answered as a 400) that names the request field it is about."""
    err = ValueError(message)
    err.param = param
    return err


def error_body(message: str, status: int = 400, param: str | None = None) -> dict:
    """vLLM's OpenAI-style error: {"error": {"message", "type", "param", "code"}}."""
    phrase = HTTPStatus(status).phrase.replace(" ", "")
    err_type = phrase if phrase.endswith("Error") else phrase + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


ERROR_RESPONSE_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """One readable line for a pydantic error, and the top-level field it is about."""
    first = error.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    param = str(first["loc"][0]) if first["loc"] else None
    msg = first["msg"]
    return (f"{loc}: {msg}" if loc else msg), param


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored (the server logs them), as vLLM and OpenAI do: SDKs send
    # fields that older servers do not know.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    seed: int | None = Field(None, ge=-_INT64 - 1, le=_INT64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    best_of: int | None = Field(None, ge=1, le=128)  # each is a sequence: bounded as n is
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    prompt_logprobs: int | None = Field(None, ge=-1)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    # structured outputs (entrypoints/openai/structured_outputs.py reads them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def _logprobs(self) -> int | None:
        raise NotImplementedError

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def _logit_bias(self) -> dict[int, float] | None:
        """logit_bias with token-id keys, each value clamped into [-100, 100] as OpenAI does."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(
                    f"logit_bias keys must be token ids (integers, as strings), got {key!r}.", "logit_bias"
                ) from None
            bias[token] = min(_LOGIT_BIAS_LIMIT, max(-_LOGIT_BIAS_LIMIT, value))
        return bias

    def to_sampling_params(
        self,
        max_tokens: int,
        defaults: dict[str, Any],
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """SamplingParams for this request; `max_tokens` is already resolved by the caller
        (it depends on the prompt length), and so is the constraint the request's
        structured-output (or tool) fields make. Raises ValueError on out-of-range values."""

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            if value is not None:
                return value
            return defaults.get(name, fallback)

        return SamplingParams(
            n=self.n,
            best_of=self.best_of,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=self._logprobs(),
            prompt_logprobs=self._prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=structured_outputs,
            # a stream sends what is new each step; an answer sent whole needs only the final output
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )

    def to_beam_search_params(
        self, max_tokens: int, structured_outputs: StructuredOutputsParams | None = None
    ) -> BeamSearchParams | None:
        """With `use_beam_search`, vLLM's reading of the request: n beams, returned best first,
        under the request's constraint if it has one."""
        if not self.use_beam_search:
            return None
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature if self.temperature is not None else 0.0,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured_outputs,
        )

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given when stream is true.")

    def check_logprobs(self) -> None:
        """vLLM's rules on the logprob (and best_of) fields that a JSON schema cannot say."""
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise bad_request(
                "best_of greater than n cannot be streamed (the best are known only at the end).", "best_of"
            )
        p = self.prompt_logprobs
        if self.stream and p is not None and (p > 0 or p == -1):
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


# Prompts one completion request may batch: each becomes n sequences with their own state.
MAX_PROMPTS_PER_REQUEST = 2048


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] | None = Field(None, union_mode="left_to_right")
    # vLLM's prompt embeddings: base64 torch.save files of [length, hidden] tensors (one or a list)
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None
    add_special_tokens: bool = True

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        # With echo, the echoed prompt tokens carry logprobs too (vLLM asks for them this way).
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids); none beside prompt_embeds."""
        if self.prompt is None or (self.prompt_embeds is not None and self.prompt in ("", [])):
            if self.prompt_embeds is None:
                raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
            return []
        return prompt_list(self.prompt, "prompt")

    def embeds_list(self) -> list[str]:
        """The prompt_embeds field as a list of base64 tensors (they come before the prompts)."""
        embeds = self.prompt_embeds
        if embeds is None:
            return []
        embeds = [embeds] if isinstance(embeds, str) else embeds
        if not embeds or len(embeds) > MAX_PROMPTS_PER_REQUEST:
            raise bad_request(
                f"prompt_embeds must hold 1 to {MAX_PROMPTS_PER_REQUEST} tensors.", "prompt_embeds"
            )
        if self.echo:
            raise bad_request("echo is not supported with prompt_embeds.", "echo")
        if self.use_beam_search:
            raise bad_request("use_beam_search is not supported with prompt_embeds.", "use_beam_search")
        return embeds


def prompt_list(p: str | list, field: str) -> list[str | list[int]]:
    """A prompt field (one text, texts, one token-id list or several) as a list of prompts."""
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request(f"{field} must not be empty.", field)
    if isinstance(p[0], int):
        return [list(p)]
    if len(p) > MAX_PROMPTS_PER_REQUEST:
        raise bad_request(
            f"{field} holds {len(p)} prompts; one request may batch at most {MAX_PROMPTS_PER_REQUEST}.", field
        )
    return list(p)


# A message's content parts as the OpenAPI document describes them (text, and images by URL: data:,
# file:// under --allowed-local-media-path, http(s)); the server reads any part and answers a
# part of another type with a 400 (chat_prompt.py).
CONTENT_PART_SCHEMA = {
    "oneOf": [
        {
            "type": "object",
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
            "required": ["type", "text"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "image_url"},
                "image_url": {
                    "type": "object",
                    "properties": {"url": {"type": "string"}, "detail": {"type": "string"}},
                    "required": ["url"],
                },
            },
            "required": ["type", "image_url"],
        },
    ]
}


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[Annotated[dict[str, Any], WithJsonSchema(CONTENT_PART_SCHEMA)]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of the next
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def _logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def check_logprobs(self) -> None:
        super().check_logprobs()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_messages(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None  # the template renders them, as for the chat request
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]
