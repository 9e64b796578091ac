"""The `tools` of a chat request: checked, turned into the constraint `tool_choice` asks for, and
the parser that finds the calls in the reply.

tool_choice (OpenAI's, as vLLM reads it): "none" (tools only reach the template), "auto" (the
model decides; its calls are found by --tool-call-parser, which needs --enable-auto-tool-choice),
"required" (at least one call) and a named function. The last two are enforced by a grammar
built from the tools' JSON schemas, so even a model that never learned the format returns
valid calls: "required" generates a JSON array of {"name", "parameters"} objects, a named
function its arguments alone. Left out, tool_choice is "auto" with tools and "none" without.
"""

from __future__ import annotations

from typing import Any

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, bad_request
from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser
from jaxserve.entrypoints.openai.tool_parsers.base import (
    Broken,
    ParsedCall,
    ParsedText,
    ToolParser,
    json_call_array,
    skip_ws,
)
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured_output.grammar import close_objects

_ANY_OBJECT = {"type": "object"}


def _functions(body: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each tool; a 400 for a tool that is not a function."""
    out = {}
    for i, tool in enumerate(body.tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}.", "tools"
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
        out[fn["name"]] = params or _ANY_OBJECT
    return out


def tool_choice_mode(body: ChatCompletionRequest, auto_parser: str | None) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function); a 400 for a choice the
    request or the server cannot honour. auto_parser: --tool-call-parser when
    --enable-auto-tool-choice is set, else None."""
    functions = _functions(body)
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                              "'function': {'name': ...}}.", "tool_choice")  # fmt: skip
        if name not in functions:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not in tools.", "tool_choice"
            )
        return "named", name
    if choice not in ("none", "auto", "required"):
        raise bad_request(
            f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}.", "tool_choice"
        )
    if choice != "none" and not functions:
        raise bad_request(f"tool_choice {choice!r} needs tools.", "tool_choice")
    if choice == "auto" and auto_parser is None:
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set.',
            "tool_choice",
        )
    return choice, None


# Between a forced call's JSON tokens: one optional space. It admits the compact form and the
# one json.dumps writes (what models are trained to call tools with), and no more: with JSON's
# free whitespace a small model at temperature 1 can spend its whole max_tokens on newlines
# without closing the call (vLLM's grammars allow that).
CALL_WHITESPACE = " ?"


def tool_constraint(
    body: ChatCompletionRequest, mode: str, name: str | None
) -> StructuredOutputsParams | None:
    """The grammar that makes the reply a valid call: a named function's arguments, or for
    "required" an array of calls (one at most when parallel_tool_calls is false)."""
    functions = {fn: close_objects(params, declared_only=True) for fn, params in _functions(body).items()}
    pattern = body.guided_whitespace_pattern
    whitespace = {"whitespace_pattern": CALL_WHITESPACE if pattern is None else pattern}
    if mode == "named":
        return StructuredOutputsParams(json=functions[name], **whitespace)
    if mode != "required":
        return None
    call = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [fn]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for fn, params in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, **whitespace)


class NamedToolParser(ToolParser):
    """The reply is the named function's arguments (tool_choice names a function)."""

    def __init__(self, name: str):
        super().__init__(None)
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedText:
        start = skip_ws(text, 0)
        return ParsedText(
            "", [ParsedCall(self.name, text[start:].rstrip() if final else text[start:], final)]
        )


class RequiredToolParser(ToolParser):
    """The reply is a JSON array of {"name", "parameters"} objects (tool_choice "required")."""

    def parse(self, text: str, final: bool) -> ParsedText:
        i = skip_ws(text, 0)
        if not text.startswith("[", i):
            return ParsedText(text if final else "", [])
        try:
            calls, _ = json_call_array(text, i, args_keys=("parameters", "arguments"))
        except Broken:  # the grammar rules this out; a reply that is not calls is content
            return ParsedText(text if final else "", [])
        return ParsedText("", calls)


class FirstCallOnly(ToolParser):
    """parallel_tool_calls false under "auto": the first call the model's parser finds and no
    other (the grammar of "required" allows one call only; a named function is one call)."""

    def __init__(self, parser: ToolParser):
        super().__init__(parser.tokenizer)
        self.parser = parser
        self.keeps_special_tokens = parser.keeps_special_tokens
        self.tool_call_id_kind = parser.tool_call_id_kind

    def parse(self, text: str, final: bool) -> ParsedText:
        parsed = self.parser.parse(text, final)
        return ParsedText(parsed.content, parsed.calls[:1])


def reply_tool_parser(
    mode: str, name: str | None, server_parser: str | None, tokenizer: Any, parallel: bool = True
) -> ToolParser | None:
    """What finds the calls in the reply of a request in `mode`. server_parser: --tool-call-parser
    (the model's own format); a forced call takes its ids from it too, since the model's template
    reads them back on the next turn (Mistral's accepts only 9 alphanumerics)."""
    if mode == "auto":
        parser = get_tool_parser(server_parser)(tokenizer)
        return parser if parallel else FirstCallOnly(parser)
    if mode not in ("named", "required"):
        return None
    parser = NamedToolParser(name) if mode == "named" else RequiredToolParser(None)
    if server_parser is not None:
        parser.tool_call_id_kind = get_tool_parser(server_parser).tool_call_id_kind
    return parser
