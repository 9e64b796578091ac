"""Qwen3-Coder's XML calls, text may come before:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is taken as JSON where it parses as JSON (numbers, booleans, null, objects, arrays),
else as a string (vLLM reads the types from the tool's schema; a string parameter whose value
reads as JSON, such as "42", comes back as that JSON value here). While it streams, a call's
arguments grow one whole parameter at a time."""

from __future__ import annotations

import json

from jaxserve.entrypoints.openai.tool_parsers.base import (
    Assembler,
    ParsedCall,
    ParsedText,
    ToolParser,
    hold_back,
)

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def _value(raw: str) -> str:
    text = raw.strip("\n")
    try:
        json.loads(text)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)
    return text.strip()


def _call(text: str, i: int) -> tuple[ParsedCall | None, int | None]:
    """The call in the <tool_call> at text[i]: (the call, None until its name is whole, complete
    once </function> closes it; the index past </tool_call>, None while that is still to come)."""
    f = text.find(FUNCTION, i)
    name_end = text.find(">", f) if f >= 0 else -1
    if name_end < 0:
        return None, None
    name, j, members = text[f + len(FUNCTION) : name_end].strip(), name_end + 1, []
    while True:
        p, done = text.find(PARAMETER, j), text.find(FUNCTION_END, j)
        if done >= 0 and (p < 0 or done < p):
            e = text.find(END, done)
            arguments = "{" + ", ".join(members) + "}"
            return ParsedCall(name, arguments, True), (e + len(END) if e >= 0 else None)
        key_end = text.find(">", p) if p >= 0 else -1
        value_end = text.find(PARAMETER_END, key_end) if key_end >= 0 else -1
        if value_end < 0:
            return ParsedCall(name, "{" + ", ".join(members), False), None
        key = text[p + len(PARAMETER) : key_end].strip()
        members.append(f"{json.dumps(key, ensure_ascii=False)}: {_value(text[key_end + 1 : value_end])}")
        j = value_end + len(PARAMETER_END)


class Qwen3CoderToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        out = Assembler()
        pos = 0
        while True:
            k = text.find(START, pos)
            if k < 0:
                out.text(text[pos:] if final else hold_back(text[pos:], (START,)))
                break
            out.text(text[pos:k])
            call, end = _call(text, k + len(START))
            if end is None:
                if final and (call is None or not call.complete):
                    out.text(text[k:])  # never became a whole call: its text is content
                elif call is not None:  # (a last call may lack its </tool_call>)
                    out.call(call)
                break
            out.call(call)
            pos = end
        return out.result(final)
