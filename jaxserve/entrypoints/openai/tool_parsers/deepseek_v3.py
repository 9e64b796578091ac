"""DeepSeek-V3 / R1 calls, between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, each

    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...arguments...}
    ```<｜tool▁call▁end｜>

(the markers are special tokens). Text before the calls is content."""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.base import (
    Assembler,
    Broken,
    Incomplete,
    ParsedCall,
    ParsedText,
    ToolParser,
    hold_back,
    json_value_end,
    parse_json,
    skip_ws,
)

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE, FENCE_END = "```json\n", "```"


def _call(text: str, i: int) -> tuple[ParsedCall | None, int | None]:
    """The call whose CALL marker is at text[i]: (the call, None until its name is whole; the
    index past its CALL_END, None while it runs on)."""
    sep = text.find(SEP, i)
    if sep < 0:
        if not "function".startswith(text[i + len(CALL) :][: len("function")]):
            raise Broken
        return None, None
    newline = text.find("\n", sep)
    if newline < 0:
        return None, None
    name, a = text[sep + len(SEP) : newline].strip(), newline + 1
    if not text.startswith(FENCE, a):
        if FENCE.startswith(text[a:]):
            return ParsedCall(name, "", False), None
        raise Broken
    a += len(FENCE)
    try:
        end = json_value_end(text, a)
    except Incomplete:
        return ParsedCall(name, text[a:], False), None
    if not isinstance(parse_json(text[a:end]), dict):
        raise Broken
    call, b = ParsedCall(name, text[a:end], False), skip_ws(text, end)
    if text.startswith(FENCE_END, b):
        c = skip_ws(text, b + len(FENCE_END))
        if text.startswith(CALL_END, c):
            return ParsedCall(name, text[a:end], True), c + len(CALL_END)
        if CALL_END.startswith(text[c:]):
            return call, None
    elif FENCE_END.startswith(text[b:]):
        return call, None
    raise Broken


class DeepSeekV3ToolParser(ToolParser):
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedText:
        out = Assembler()
        k = text.find(BEGIN)
        if k < 0:
            out.text(text if final else hold_back(text, (BEGIN,)))
            return out.result(final)
        out.text(text[:k])
        pos = k + len(BEGIN)
        while True:
            j = skip_ws(text, pos)
            if text.startswith(END, j):
                out.text(text[j + len(END) :])
                break
            if j == len(text) or (not final and (CALL.startswith(text[j:]) or END.startswith(text[j:]))):
                break
            try:
                if not text.startswith(CALL, j):
                    raise Broken
                call, end = _call(text, j)
            except Broken:
                out.text(text[j if out.calls else k :])  # never became a call: its text is content
                break
            if end is None:
                if final:
                    out.text(text[j if out.calls else k :])
                elif call is not None:
                    out.call(call)
                break
            out.call(call)
            pos = end
        return out.result(final)
