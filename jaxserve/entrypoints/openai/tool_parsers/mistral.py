"""Mistral tool calls: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (v0.3 tokenizers)
or, in the newer tokenizers, [TOOL_CALLS]name[ARGS]{...} once per call (with [CALL_ID]id
before [ARGS] in some). Mistral's templates want tool call ids of 9 alphanumerics."""

from __future__ import annotations

import re

from jaxserve.entrypoints.openai.tool_parsers.base import (
    Assembler,
    Broken,
    Incomplete,
    ParsedCall,
    ParsedText,
    ToolParser,
    hold_back,
    json_call_array,
    json_value_end,
    parse_json,
    skip_ws,
)

_NAME = re.compile(r"[\w\-.]+")
_CALL_ID_VALUE = re.compile(r"\w*")


class MistralToolParser(ToolParser):
    keeps_special_tokens = True
    tool_call_id_kind = "mistral"
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"
    call_id_marker = "[CALL_ID]"

    def parse(self, text: str, final: bool) -> ParsedText:
        out = Assembler()
        marker = self.marker
        pos = 0
        while True:
            k = text.find(marker, pos)
            if k < 0:
                out.text(text[pos:] if final else hold_back(text[pos:], (marker,)))
                break
            out.text(text[pos:k])
            j = skip_ws(text, k + len(marker))
            try:
                if j == len(text):
                    calls, end = [], None
                elif text[j] == "[":
                    calls, end = json_call_array(text, j)
                else:
                    calls, end = self._named(text, j)
                broken = False
            except Broken:
                calls, end, broken = [], None, True
            if end is None and (final or broken):
                out.text(marker)  # never became calls: its text is content
                pos = k + len(marker)
                continue
            for call in calls:
                out.call(call)
            if end is None:
                break
            pos = end
        return out.result(final)

    def _named(self, text: str, i: int) -> tuple[list[ParsedCall], int | None]:
        """The call written name[ARGS]{...} at text[i], and the index past it (None while open)."""
        m = _NAME.match(text, i)
        if m is None:
            raise Broken
        j = m.end()
        if j == len(text):
            return [], None  # the name may go on
        pending = [ParsedCall(m.group(), "", False)]
        if text.startswith(self.call_id_marker, j):
            j = _CALL_ID_VALUE.match(text, j + len(self.call_id_marker)).end()
        if not text.startswith(self.args_marker, j):
            rest = text[j:]
            if self.args_marker.startswith(rest) or self.call_id_marker.startswith(rest):
                return pending, None
            raise Broken
        s = skip_ws(text, j + len(self.args_marker))
        if s == len(text):
            return pending, None
        if text[s] != "{":
            raise Broken
        try:
            e = json_value_end(text, s)
        except Incomplete:
            return [ParsedCall(m.group(), text[s:], False)], None
        if not isinstance(parse_json(text[s:e]), dict):
            raise Broken
        return [ParsedCall(m.group(), text[s:e], True)], e
