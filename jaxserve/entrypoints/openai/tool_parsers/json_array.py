"""Formats whose calls are one JSON array after a marker: Granite ("<|tool_call|>[...]", 3.0, or
"<tool_call>[...]", 3.1+) and Phi-4-mini ("functools[...]"); each call is {"name": ...,
"arguments": {...}} ("parameters" is taken too). Text before the marker is content."""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.base import (
    Assembler,
    Broken,
    ParsedText,
    ToolParser,
    hold_back,
    json_call_array,
    skip_ws,
)


class JsonArrayToolParser(ToolParser):
    markers: tuple[str, ...] = ()

    def parse(self, text: str, final: bool) -> ParsedText:
        out = Assembler()
        found = [(k, m) for m in self.markers if (k := text.find(m)) >= 0]
        if not found:
            out.text(text if final else hold_back(text, self.markers))
            return out.result(final)
        k, marker = min(found)
        out.text(text[:k])
        j = skip_ws(text, k + len(marker))
        if j == len(text) and not final:
            return out.result(final)
        try:
            if not text.startswith("[", j):
                raise Broken
            calls, end = json_call_array(text, j)
        except Broken:  # never became calls: its text is content
            out.text(text[k:])
            return out.result(final)
        if end is None and final:
            out.text(text[k:])
            return out.result(final)
        for call in calls:
            out.call(call)
        if end is not None:
            out.text(text[end:])
        return out.result(final)


class GraniteToolParser(JsonArrayToolParser):
    keeps_special_tokens = True
    markers = ("<|tool_call|>", "<tool_call>")


class Phi4MiniJsonToolParser(JsonArrayToolParser):
    markers = ("functools",)
