"""Llama 3.1 / 3.2 / 3.3 JSON tool calling: the reply is {"name": ..., "parameters": {...}}
("arguments" is taken too), maybe after <|python_tag|>, several separated by "; ". A reply
that is not such JSON is content."""

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


class Llama3JsonToolParser(ToolParser):
    keeps_special_tokens = True
    python_tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedText:
        out = Assembler()
        tag = self.python_tag
        pos = text.find(tag)
        if pos >= 0:
            out.text(text[:pos])
        elif text[skip_ws(text, 0) :].startswith("{"):
            pos = 0
        else:
            out.text(text if final else hold_back(text, (tag,)))
            return out.result(final)
        # From pos on: calls; text from `region` on that does not parse as one is content.
        region = pos
        while True:
            j = skip_ws(text, pos + len(tag) if text.startswith(tag, pos) else pos)
            try:
                call, end = json_call(text, j, args_keys=("parameters", "arguments"))
                broken = False
            except Broken:
                call, end, broken = None, None, True
            if end is None:
                if final or broken:
                    out.text(text[region:])
                elif call is not None:
                    out.call(call)
                break
            out.call(call)
            region = end
            j = skip_ws(text, end)
            if text.startswith(";", j):
                pos = j + 1
            elif text.startswith("{", j):
                pos = j
            else:
                out.text(text[end:])
                break
        return out.result(final)
