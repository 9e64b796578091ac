"""The common part of the tool-call parsers: what a parse gives, the OpenAI shapes made of it
(whole message and streamed deltas), and a small scanner for JSON that is still being written.

A parser is a pure function of the cumulative generated text, so one parser serves every request
and streaming is a diff of two parses; per-choice state lives in `ToolCallStream`.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedCall:
    name: str | None
    arguments: str  # a JSON object's text, or a prefix of it while the call is being written
    complete: bool


@dataclass
class ParsedText:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


_ALNUM = string.ascii_letters + string.digits


def make_tool_call_id(kind: str = "random") -> str:
    """A tool call id: OpenAI-like by default; "mistral" templates accept only 9 alphanumerics."""
    if kind == "random":
        return f"chatcmpl-tool-{uuid.uuid4().hex}"
    if kind == "mistral":
        return "".join(random.choices(_ALNUM, k=9))
    raise ValueError(f"unknown tool call id kind {kind!r}")


class ToolParser(ABC):
    """Finds the tool calls in a model's output.

    `parse(text, final)` must be monotone in the text: for t1 a prefix of t2, the content of
    parse(t1, False) is a prefix of that of parse(t2, ...), its calls are the first calls of the
    other with the same names and with arguments that are prefixes. So, while not final, a tail
    that may still become a marker is held back, and a call shows only once its name is known.
    With final=True everything is given: text that never became a valid call is content. A call
    found invalid after it was streamed is the one case that breaks the rule (it turns to content).
    """

    # True when the format's markers are special tokens that skip_special_tokens would strip.
    keeps_special_tokens: bool = False
    tool_call_id_kind: str = "random"

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedText:
        """Content and calls of the generated text so far (see the class's rule)."""

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, OpenAI tool calls) of a finished message; content is None when blank."""
        parsed = self.parse(text, final=True)
        calls = [
            {
                "id": make_tool_call_id(self.tool_call_id_kind),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in parsed.calls
            if c.complete and c.name is not None
        ]
        return (parsed.content if parsed.content.strip() else None), calls


class ToolCallStream:
    """One streamed choice: turns successive parses of its growing text into OpenAI deltas."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.ids: list[str] = []
        self._content_sent = 0
        self._args_sent: list[int] = []

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def update(self, text: str, final: bool) -> dict:
        """The delta for what `text` (all the choice's text so far) adds since the last update."""
        parsed = self.parser.parse(text, final)
        delta: dict[str, Any] = {}
        if len(parsed.content) > self._content_sent:
            delta["content"] = parsed.content[self._content_sent :]
            self._content_sent = len(parsed.content)
        fragments = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(make_tool_call_id(self.parser.tool_call_id_kind))
                self._args_sent.append(0)
                fragments.append(
                    {
                        "index": i,
                        "id": self.ids[i],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            if len(call.arguments) > self._args_sent[i]:
                new = call.arguments[self._args_sent[i] :]
                fragments.append({"index": i, "function": {"arguments": new}})
                self._args_sent[i] = len(call.arguments)
        if fragments:
            delta["tool_calls"] = fragments
        return delta


class Assembler:
    """Collects a parse: text outside calls, and calls. Text that is only whitespace next to
    calls is dropped; while not final, text that is only whitespace so far is held back (a call
    may follow)."""

    def __init__(self) -> None:
        self.segments = [""]
        self.calls: list[ParsedCall] = []

    def text(self, s: str) -> None:
        self.segments[-1] += s

    def call(self, call: ParsedCall) -> None:
        self.calls.append(call)
        self.segments.append("")

    def result(self, final: bool) -> ParsedText:
        if self.calls:
            content = "".join(s for s in self.segments if s.strip())
        else:
            content = self.segments[0] if final or self.segments[0].strip() else ""
        return ParsedText(content, self.calls)


def hold_back(text: str, markers: tuple[str, ...]) -> str:
    """`text` less a tail that could still grow into one of `markers`."""
    for k in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(len(m) > k and m.startswith(text[-k:]) for m in markers):
            return text[:-k]
    return text


# A scanner for JSON being generated: it finds where values end without needing the whole text.


class Incomplete(Exception):
    """The text ends before the value does."""


class Broken(Exception):
    """No continuation of the text can make it the expected structure."""


_WS = " \t\r\n"
_CLOSERS = {"{": "}", "[": "]"}
_PRIMITIVE = set("-+.0123456789eEtruefalsn")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
_NOT_STRUCTURE = re.compile(r'[^"{}\[\]]*')


def _string_end(text: str, i: int) -> int:
    j = _STRING_BODY.match(text, i + 1).end()
    if j < len(text) and text[j] == '"':
        return j + 1
    raise Incomplete


def json_value_end(text: str, i: int) -> int:
    """The index past the JSON value that starts at text[i]. Brackets are matched and strings
    skipped; whether the value is valid JSON is for json.loads to say once it is whole."""
    if i >= len(text):
        raise Incomplete
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in _CLOSERS:
        stack = [_CLOSERS[c]]
        j = i + 1
        while j < len(text):
            j = _NOT_STRUCTURE.match(text, j).end()
            if j == len(text):
                break
            c = text[j]
            if c == '"':
                j = _string_end(text, j)
                continue
            if c in _CLOSERS:
                stack.append(_CLOSERS[c])
            elif c in "]}":
                if c != stack.pop():
                    raise Broken
                if not stack:
                    return j + 1
            j += 1
        raise Incomplete
    if c in _PRIMITIVE:
        j = i
        while j < len(text) and text[j] in _PRIMITIVE:
            j += 1
        if j == len(text):
            raise Incomplete
        return j
    raise Broken


def parse_json(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        raise Broken from None


def json_object_members(text: str, i: int) -> tuple[list[tuple[str, int, int | None]], int | None]:
    """The members of the JSON object opening at text[i], as far as the text goes:
    [(key, value start, value end or None while it runs on)], and the index past the object's
    closing brace (None while it is open)."""
    if i >= len(text):
        return [], None
    if text[i] != "{":
        raise Broken
    members: list[tuple[str, int, int | None]] = []
    j = skip_ws(text, i + 1)
    if text.startswith("}", j):
        return members, j + 1
    while j < len(text):
        if text[j] != '"':
            raise Broken
        try:
            k = _string_end(text, j)
        except Incomplete:
            return members, None
        key = parse_json(text[j:k])
        j = skip_ws(text, k)
        if j == len(text):
            return members, None
        if text[j] != ":":
            raise Broken
        j = skip_ws(text, j + 1)
        if j == len(text):
            return members, None
        try:
            end = json_value_end(text, j)
        except Incomplete:
            members.append((key, j, None))
            return members, None
        members.append((key, j, end))
        j = skip_ws(text, end)
        if j == len(text):
            return members, None
        if text[j] == "}":
            return members, j + 1
        if text[j] != ",":
            raise Broken
        j = skip_ws(text, j + 1)
    return members, None


def json_arguments(text: str, start: int, end: int | None) -> str:
    """A call's arguments from the value at text[start:end]: an object's own text (so far), or
    a JSON string holding an object, given once the string is whole."""
    if text[start] == "{":
        return text[start:end] if end is not None else text[start:]
    if text[start] == '"':
        if end is None:
            return ""
        inner = parse_json(text[start:end])
        if not isinstance(parse_json(inner), dict):
            raise Broken
        return inner
    raise Broken


def json_call(
    text: str, i: int, args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> tuple[ParsedCall | None, int | None]:
    """The call written as a JSON object {"name": ..., <args key>: {...}} at text[i]: (the call,
    None until its name is known; the index past the object, None while it is open)."""
    members, end = json_object_members(text, i)
    name = arguments = None
    for key, start, stop in members:
        if key == "name" and name is None and stop is not None:
            name = parse_json(text[start:stop])
            if not isinstance(name, str):
                raise Broken
        elif key in args_keys and arguments is None:
            arguments = json_arguments(text, start, stop)
    if end is None:
        return (ParsedCall(name, arguments or "", False) if name is not None else None), None
    if name is None or not isinstance(parse_json(text[i:end]), dict):
        raise Broken
    return ParsedCall(name, arguments if arguments is not None else "{}", True), end


def json_call_array(
    text: str, i: int, args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> tuple[list[ParsedCall], int | None]:
    """The calls of the JSON array [{"name": ..., <args key>: {...}}, ...] opening at text[i], and
    the index past it (None while it is open)."""
    calls = []
    j = skip_ws(text, i + 1)
    while True:
        call, end = json_call(text, j, args_keys)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls, None
        j = skip_ws(text, end)
        if j == len(text):
            return calls, None
        if text[j] == "]":
            return calls, j + 1
        if text[j] != ",":
            raise Broken
        j = skip_ws(text, j + 1)
