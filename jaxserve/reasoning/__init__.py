"""Reasoning parsers (vLLM's `--reasoning-parser`): split a thinking model's output into
`reasoning_content` and `content`, and tell from token ids when the thinking has ended."""

from __future__ import annotations

from collections.abc import Callable

from jaxserve.reasoning.base import ReasoningParser
from jaxserve.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from jaxserve.reasoning.glm45 import Glm45ReasoningParser
from jaxserve.reasoning.granite import GraniteReasoningParser
from jaxserve.reasoning.qwen3 import Qwen3ReasoningParser
from jaxserve.reasoning.stream import ReasoningStream

__all__ = [
    "ReasoningParser",
    "ReasoningStream",
    "DeepSeekR1ReasoningParser",
    "Glm45ReasoningParser",
    "GraniteReasoningParser",
    "Qwen3ReasoningParser",
    "register_reasoning_parser",
    "get_reasoning_parser",
    "reasoning_parser_names",
]

_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    """Class decorator that makes a parser available as `--reasoning-parser name`."""

    def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        _PARSERS[name] = cls
        return cls

    return register


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        known = ", ".join(reasoning_parser_names())
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}") from None


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


register_reasoning_parser("deepseek_r1")(DeepSeekR1ReasoningParser)
register_reasoning_parser("qwen3")(Qwen3ReasoningParser)
register_reasoning_parser("glm45")(Glm45ReasoningParser)
register_reasoning_parser("granite")(GraniteReasoningParser)
