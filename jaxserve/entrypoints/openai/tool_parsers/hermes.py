"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2 Pro / 3): each call is a JSON object
{"name": ..., "arguments": {...}} inside <tool_call>...</tool_call>, text may come before."""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.base import (
    Assembler,
    Broken,
    ParsedText,
    ToolParser,
    hold_back,
    json_call,
    skip_ws,
)


class HermesToolParser(ToolParser):
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedText:
        out = Assembler()
        start, end_marker = self.start_marker, self.end_marker
        pos = 0
        while True:
            k = text.find(start, pos)
            if k < 0:
                out.text(text[pos:] if final else hold_back(text[pos:], (start,)))
                break
            out.text(text[pos:k])
            try:
                call, end = json_call(text, skip_ws(text, k + len(start)))
                broken = False
            except Broken:
                call, end, broken = None, None, True
            if end is None:
                if not (final or broken):
                    if call is not None:
                        out.call(call)
                    break
                out.text(start)  # never became a call: its text is content
                pos = k + len(start)
                continue
            out.call(call)
            j = skip_ws(text, end)
            if text.startswith(end_marker, j):
                pos = j + len(end_marker)
            elif end_marker.startswith(text[j:]):
                pos = len(text)  # the closing tag is (maybe) still to come
            else:
                pos = end
        return out.result(final)
