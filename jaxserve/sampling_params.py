"""Per-request sampling settings, with vLLM's field names and defaults.

A SamplingParams travels with its Request from the API surface to the scheduler; the
runner only ever sees the per-row numbers it needs (temperature, top_k, ...), packed
into arrays so that any mix of settings in one batch runs the same compiled step.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

# Below this temperature a request is treated as greedy, as vLLM does.
_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """Which outputs a request reports while it runs (vLLM's names): every step's cumulative
    output; only what is new since the last one (what a stream sends: its cost per step does not
    grow with the output's length); or only the final one (what the offline LLM and non-streamed
    answers need, and the engine then builds no output for the request until it finishes)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# The kinds of constraint a StructuredOutputsParams can carry; exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's structured outputs): a JSON schema
    (`json`, a dict or its text), any JSON object (`json_object`), a regular expression, one of
    several strings (`choice`), or a Lark/GBNF grammar. The engine compiles it to a grammar and
    masks, at every step, the tokens that would leave it."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # The older GuidedDecodingParams' per-request backend (None: the engine's).
    backend: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, regex, choice, grammar, json_object or "
                f"structural_tag; got {', '.join(given) if given else 'none'}."
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured outputs choice must be a non-empty list of strings.")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> Any:
        return getattr(self, self.kind)


# vLLM's older name for the same thing (SamplingParams.guided_decoding).
GuidedDecodingParams = StructuredOutputsParams


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: GuidedDecodingParams | None = None  # the older name of structured_outputs
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
                raise ValueError("Give structured_outputs or guided_decoding, not both.")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other knobs no longer matter; normalise them so rows compare equal.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            raise bad("best_of", f"must be an integer >= n ({self.n})")
        if (self.best_of or 1) > 1 and self.temperature < _GREEDY_EPS:
            raise bad("best_of", "must be 1 when using greedy sampling (temperature 0)")
        if self.temperature < 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disable), or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "must be positive")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < -1):
                raise bad(name, "must be a non-negative integer (or -1 for all)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)
