"""Tool-call parsers (vLLM's `--tool-call-parser`): find the function calls in a model's output
for the chat endpoint's `tools`, whole or while it streams. `--tool-parser-plugin` loads more
from a Python file that registers them with `register_tool_parser`."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable

from jaxserve.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    ParsedText,
    ToolCallStream,
    ToolParser,
    make_tool_call_id,
)
from jaxserve.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from jaxserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from jaxserve.entrypoints.openai.tool_parsers.internlm import InternLMToolParser
from jaxserve.entrypoints.openai.tool_parsers.json_array import GraniteToolParser, Phi4MiniJsonToolParser
from jaxserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from jaxserve.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from jaxserve.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

__all__ = [
    "DeepSeekV3ToolParser",
    "GraniteToolParser",
    "HermesToolParser",
    "InternLMToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "Phi4MiniJsonToolParser",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "ParsedCall",
    "ParsedText",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
    "import_tool_parser_plugin",
    "make_tool_call_id",
    "register_tool_parser",
    "tool_parser_names",
]

_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator that makes a parser available as `--tool-call-parser name`."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        _PARSERS[name] = cls
        return cls

    return register


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        known = ", ".join(tool_parser_names())
        raise ValueError(f"unknown tool call parser {name!r}; known parsers: {known}") from None


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def import_tool_parser_plugin(path: str) -> None:
    """Run the Python file at `path`, whose parsers register themselves when it is imported."""
    module_name = "jaxserve_tool_parser_plugin_" + re.sub(r"\W", "_", os.path.basename(path))
    spec = importlib.util.spec_from_file_location(module_name, path) if os.path.isfile(path) else None
    if spec is None or spec.loader is None:
        raise ValueError(f"tool parser plugin {path!r} is not a readable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ValueError(f"tool parser plugin {path!r} failed to load: {e}") from e


register_tool_parser("hermes")(HermesToolParser)
register_tool_parser("llama3_json")(Llama3JsonToolParser)
register_tool_parser("mistral")(MistralToolParser)
register_tool_parser("pythonic")(PythonicToolParser)
register_tool_parser("deepseek_v3")(DeepSeekV3ToolParser)
register_tool_parser("granite")(GraniteToolParser)
register_tool_parser("internlm")(InternLMToolParser)
register_tool_parser("phi4_mini_json")(Phi4MiniJsonToolParser)
register_tool_parser("qwen3_coder")(Qwen3CoderToolParser)
