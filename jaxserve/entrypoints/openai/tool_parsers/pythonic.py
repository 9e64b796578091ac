"""Pythonic tool calls (Llama 3.2 / Llama 4 pythonic, and others): the reply is a Python list of
calls with literal keyword arguments, [get_weather(city="Paris", days=3), f()]. A call's
arguments are given once the call is whole; if any call is not of that form, all is content."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from jaxserve.entrypoints.openai.tool_parsers.base import (
    Broken,
    Incomplete,
    ParsedCall,
    ParsedText,
    ToolParser,
    skip_ws,
)

_NAME = re.compile(r"[A-Za-z_]\w*")
_CLOSERS = {"(": ")", "[": "]", "{": "}"}
_JSON_NAMES = {"true": True, "false": False, "null": None}
_NOT_STRUCTURE = re.compile(r"[^'\"()\[\]{}]*")
_STRING_BODY = {q: re.compile(rf"[^{q}\\]*(?:\\.[^{q}\\]*)*", re.DOTALL) for q in "'\""}


class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        i = skip_ws(text, 0)
        if not text.startswith("[", i):
            return ParsedText(text if final or text.strip() else "", [])
        try:
            calls, end = _calls(text, i)
        except Broken:
            return ParsedText(text, [])
        if end is None:
            return ParsedText(text, []) if final else ParsedText("", calls)
        tail = text[end:]
        return ParsedText(tail if tail.strip() else "", calls)


def _calls(text: str, i: int) -> tuple[list[ParsedCall], int | None]:
    """The calls of the list at text[i] and the index past it (None while it is open)."""
    calls: list[ParsedCall] = []
    j = skip_ws(text, i + 1)
    while True:
        m = _NAME.match(text, j)
        if m is None:
            if j == len(text):
                return calls, None
            raise Broken
        k = skip_ws(text, m.end())
        if k == len(text):
            return calls, None  # the name may go on
        if text[k] != "(":
            raise Broken
        try:
            close = _bracket_end(text, k)
        except Incomplete:
            calls.append(ParsedCall(m.group(), "", False))
            return calls, None
        calls.append(ParsedCall(m.group(), _arguments(text[m.start() : close]), True))
        j = skip_ws(text, close)
        if j == len(text):
            return calls, None
        if text[j] == "]":
            return calls, j + 1
        if text[j] != ",":
            raise Broken
        j = skip_ws(text, j + 1)


def _bracket_end(text: str, i: int) -> int:
    """The index past the bracket that matches text[i], skipping Python strings."""
    stack: list[str] = []
    j = i
    while j < len(text):
        j = _NOT_STRUCTURE.match(text, j).end()
        if j == len(text):
            break
        c = text[j]
        if c in "'\"":
            j = _string_end(text, j)
            continue
        if c in _CLOSERS:
            stack.append(_CLOSERS[c])
        elif c in ")]}":
            if c != stack.pop():
                raise Broken
            if not stack:
                return j + 1
        j += 1
    raise Incomplete


def _string_end(text: str, i: int) -> int:
    if not text.startswith(text[i] * 3, i):
        j = _STRING_BODY[text[i]].match(text, i + 1).end()
        if j < len(text) and text[j] == text[i]:
            return j + 1
        raise Incomplete
    quote = text[i] * 3
    j = i + 3
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text.startswith(quote, j):
            return j + len(quote)
        else:
            j += 1
    raise Incomplete


def _arguments(source: str) -> str:
    """The JSON object of a call's keyword arguments, all of which must be literals."""
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        raise Broken from None
    if not isinstance(node, ast.Call) or node.args or any(kw.arg is None for kw in node.keywords):
        raise Broken
    return json.dumps({kw.arg: _literal(kw.value) for kw in node.keywords}, ensure_ascii=False)


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        keys = [_literal(k) for k in node.keys]  # type: ignore[arg-type]
        if all(isinstance(k, str) for k in keys):
            return dict(zip(keys, (_literal(v) for v in node.values)))
    raise Broken
