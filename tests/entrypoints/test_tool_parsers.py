"""Tool-call parsers: each family's real output format, whole and streamed (character by character
and in random chunks), and the round trip of a tool conversation through the family's template."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from tiny_models import make_tokenizer
from tool_schemas import WEATHER as WEATHER_TOOL

from jaxserve.entrypoints.openai import tool_parsers
from jaxserve.entrypoints.openai.chat_prompt import render_chat_prompt
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest
from jaxserve.entrypoints.openai.tool_parsers import (
    ToolCallStream,
    get_tool_parser,
    import_tool_parser_plugin,
    make_tool_call_id,
    tool_parser_names,
)

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"

WEATHER = {"city": "Paris", "days": 3}
TRICKY = {
    "query": 'a "quoted" } ] text, \\ and {braces}',
    "nested": {"list": [1, -2.5, None, True]},
    "é": "日本",
}


def _stream(parser, text: str, cuts) -> tuple[str, list[dict]]:
    """Feed growing prefixes of `text` (ending at each cut, then the whole text as final) and
    put the deltas back together, checking that each call's name comes before its arguments."""
    stream = ToolCallStream(parser)
    content, calls = "", []
    points = sorted({c for c in cuts if 0 < c < len(text)})
    for n, final in [(c, False) for c in points] + [(len(text), True)]:
        delta = stream.update(text[:n], final)
        content += delta.get("content", "")
        for frag in delta.get("tool_calls", []):
            i = frag["index"]
            if "id" in frag:
                assert i == len(calls), "a call's id and name come once, in order"
                assert frag["type"] == "function" and frag["function"]["arguments"] == ""
                calls.append({"id": frag["id"], "name": frag["function"]["name"], "arguments": ""})
            else:
                assert i < len(calls), "arguments before the call's name"
                assert set(frag) == {"index", "function"} and set(frag["function"]) == {"arguments"}
                calls[i]["arguments"] += frag["function"]["arguments"]
    assert stream.ids == [c["id"] for c in calls]
    return content, calls


def _splits(text: str, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    positions = range(1, len(text))
    chunked = [sorted(rng.sample(positions, min(len(positions), k))) for k in (1, 2, 5, 13, 40)]
    return [list(positions), *chunked]


def check(name: str, text: str, content: str | None, calls: list[tuple[str, dict]], streams_calls=True):
    """Whole and streamed parses of `text` give `content` and `calls` (name, arguments object).
    With streams_calls=False (a call that breaks after its name was streamed) only the content
    of the stream is checked."""
    parser = get_tool_parser(name)(None)
    got_content, got_calls = parser.extract_tool_calls(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["type"] == "function" and c["id"] for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]
    final = parser.parse(text, final=True)
    for seed, cuts in enumerate(_splits(text, seed=len(text))):
        s_content, s_calls = _stream(parser, text, cuts)
        assert s_content == final.content, (seed, cuts)
        assert s_content.strip() == (content or "").strip()
        if streams_calls:
            assert [(c["name"], c["arguments"]) for c in s_calls] == whole, (seed, cuts)
    if streams_calls:  # the prefix rule, prefix by prefix
        for n in range(len(text) + 1):
            part = parser.parse(text[:n], final=False)
            assert final.content.startswith(part.content), text[:n]
            assert len(part.calls) <= len(final.calls)
            for a, b in zip(part.calls, final.calls, strict=False):
                assert a.name == b.name and b.arguments.startswith(a.arguments), text[:n]
    return got_calls


def test_registry_and_unknown_name():
    assert {"hermes", "llama3_json", "mistral", "pythonic", "granite", "phi4_mini_json", "internlm",
            "deepseek_v3", "qwen3_coder"} <= set(tool_parser_names())  # fmt: skip
    with pytest.raises(ValueError, match="no_such_parser.*hermes.*mistral"):
        get_tool_parser("no_such_parser")


def test_special_token_formats_keep_special_tokens():
    assert get_tool_parser("mistral").keeps_special_tokens
    assert get_tool_parser("llama3_json").keeps_special_tokens
    assert not get_tool_parser("hermes").keeps_special_tokens
    assert not get_tool_parser("pythonic").keeps_special_tokens


def test_tool_call_ids():
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", make_tool_call_id())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", make_tool_call_id("mistral"))
    with pytest.raises(ValueError):
        make_tool_call_id("nope")


# hermes (Qwen2.5 / Qwen3 / Hermes)


def _hermes(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_hermes_single_call():
    check("hermes", _hermes("get_weather", WEATHER), None, [("get_weather", WEATHER)])


def test_hermes_text_then_parallel_calls():
    text = "Let me look both up.\n" + _hermes("get_weather", WEATHER) + "\n" + _hermes("search", TRICKY)
    check("hermes", text, "Let me look both up.\n", [("get_weather", WEATHER), ("search", TRICKY)])


def test_hermes_text_after_calls_and_odd_spacing():
    text = '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>\n\nDone, see above.'
    check("hermes", text, "\n\nDone, see above.", [("f", {"a": 1})])
    text = '<tool_call>\n  {\n  "arguments": {"a": [1, 2]},\n  "name": "f"\n}\n</tool_call>'
    check("hermes", text, None, [("f", {"a": [1, 2]})])


def test_hermes_arguments_as_json_string_and_missing():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call><tool_call>{"name": "g"}</tool_call>'
    check("hermes", text, None, [("f", {"a": 1}), ("g", {})])


def test_hermes_plain_text_and_partial_marker():
    text = "The answer is 4. Use <b>bold</b> or <tool_call-ish> words."
    check("hermes", text, text, [])
    parser = get_tool_parser("hermes")(None)
    assert parser.parse("Hi <tool_", final=False).content == "Hi "
    assert parser.parse("Hi <tool_", final=True).content == "Hi <tool_"


def test_hermes_broken_calls_stay_content():
    broken_early = '<tool_call>\n{"name" "f", "arguments": {}}\n</tool_call>'
    check("hermes", broken_early, broken_early, [])
    missing_brace = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'
    check("hermes", missing_brace, missing_brace, [], streams_calls=False)
    truncated = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": '
    check("hermes", truncated, truncated, [], streams_calls=False)
    # a good call after a broken one is still a call
    text = missing_brace + "\n" + _hermes("g", {"b": 2})
    _, calls = get_tool_parser("hermes")(None).extract_tool_calls(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("g", {"b": 2})
    ]


# llama3_json (Llama 3.1 / 3.2 / 3.3)


def test_llama3_json_call():
    text = json.dumps({"name": "get_weather", "parameters": WEATHER})
    check("llama3_json", text, None, [("get_weather", WEATHER)])
    check("llama3_json", "<|python_tag|>" + text, None, [("get_weather", WEATHER)])


def test_llama3_json_several_calls_and_arguments_key():
    text = (
        "<|python_tag|>"
        + json.dumps({"name": "get_weather", "parameters": WEATHER})
        + "; "
        + json.dumps({"name": "search", "arguments": TRICKY})
    )
    check("llama3_json", text, None, [("get_weather", WEATHER), ("search", TRICKY)])


def test_llama3_json_plain_text_and_not_a_call():
    check("llama3_json", "The weather in Paris is sunny.", "The weather in Paris is sunny.", [])
    check("llama3_json", '{"answer": 42}', '{"answer": 42}', [])
    check("llama3_json", "{not json at all}", "{not json at all}", [])
    parser = get_tool_parser("llama3_json")(None)
    assert parser.parse("Hi <|python", final=False).content == "Hi "


def test_llama3_json_truncated_call_is_content():
    text = '{"name": "get_weather", "parameters": {"city": "Par'
    check("llama3_json", text, text, [], streams_calls=False)


# mistral


def test_mistral_v03_array():
    text = "[TOOL_CALLS] " + json.dumps([{"name": "get_weather", "arguments": WEATHER}])
    calls = check("mistral", text, None, [("get_weather", WEATHER)])
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0]["id"])


def test_mistral_parallel_and_text_before():
    array = [{"name": "get_weather", "arguments": WEATHER}, {"name": "search", "arguments": TRICKY}]
    text = "Checking.[TOOL_CALLS]" + json.dumps(array)
    check("mistral", text, "Checking.", [("get_weather", WEATHER), ("search", TRICKY)])


def test_mistral_named_form():
    text = (
        "[TOOL_CALLS]get_weather[ARGS]"
        + json.dumps(WEATHER)
        + "[TOOL_CALLS]search[ARGS]"
        + json.dumps(TRICKY)
    )
    check("mistral", text, None, [("get_weather", WEATHER), ("search", TRICKY)])
    text = "[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]" + json.dumps(WEATHER)
    check("mistral", text, None, [("get_weather", WEATHER)])


def test_mistral_stream_ids():
    text = "[TOOL_CALLS]" + json.dumps([{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}])
    _, calls = _stream(get_tool_parser("mistral")(None), text, range(len(text)))
    assert len(calls) == 2 and all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls)


def test_mistral_no_call_and_broken():
    check("mistral", "Paris is sunny [today].", "Paris is sunny [today].", [])
    truncated = '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}'
    check("mistral", truncated, truncated, [], streams_calls=False)
    check("mistral", "[TOOL_CALLS] nothing here", "[TOOL_CALLS] nothing here", [])


# pythonic (Llama 3.2 / 4)


def test_pythonic_call():
    check("pythonic", '[get_weather(city="Paris", days=3)]', None, [("get_weather", WEATHER)])


def test_pythonic_parallel_literals():
    text = (
        "[get_weather(city='Paris', days=3), "
        "search(query='a \"quoted\" } ] text, \\\\ and {braces}', nested={'list': [1, -2.5, None, True]}, "
        "é='日本'), noop()]"
    )
    check("pythonic", text, None, [("get_weather", WEATHER), ("search", TRICKY), ("noop", {})])


def test_pythonic_streams_each_call_whole():
    parser = get_tool_parser("pythonic")(None)
    part = parser.parse('[get_weather(city="Paris", days=3), search(query="ab', final=False)
    assert [(c.name, c.complete) for c in part.calls] == [("get_weather", True), ("search", False)]
    assert json.loads(part.calls[0].arguments) == WEATHER and part.calls[1].arguments == ""


def test_pythonic_not_calls_are_content():
    check("pythonic", "It is sunny in Paris.", "It is sunny in Paris.", [])
    check("pythonic", "[1] Source: the web.", "[1] Source: the web.", [])
    check("pythonic", "[get_weather(city=paris)]", "[get_weather(city=paris)]", [], streams_calls=False)
    text = '[get_weather(city="Paris"), get_weather("Rome")]'
    check("pythonic", text, text, [], streams_calls=False)
    check("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', [], streams_calls=False)


# plugins


def test_plugin(tmp_path, monkeypatch):
    monkeypatch.setattr(tool_parsers, "_PARSERS", dict(tool_parsers._PARSERS))
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "import json\n"
        "from jaxserve.entrypoints.openai.tool_parsers import (\n"
        "    ParsedCall, ParsedText, ToolParser, register_tool_parser)\n\n"
        "@register_tool_parser('echo_plugin')\n"
        "class Echo(ToolParser):\n"
        "    def parse(self, text, final):\n"
        "        return ParsedText('', [ParsedCall('echo', json.dumps({'text': text}), True)])\n"
    )
    import_tool_parser_plugin(str(plugin))
    assert "echo_plugin" in tool_parser_names()
    content, calls = get_tool_parser("echo_plugin")(None).extract_tool_calls("hi")
    assert content is None and calls[0]["function"] == {"name": "echo", "arguments": '{"text": "hi"}'}

    missing = str(tmp_path / "nope.py")
    with pytest.raises(ValueError, match=re.escape(missing)):
        import_tool_parser_plugin(missing)
    bad = tmp_path / "bad.py"
    bad.write_text("def broken(:\n")
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        import_tool_parser_plugin(str(bad))


# granite, phi4_mini_json, internlm, deepseek_v3, qwen3_coder: each model's own output format


def test_granite_array_after_its_marker_both_spellings():
    for marker in ("<|tool_call|>", "<tool_call>"):
        text = marker + json.dumps(
            [{"name": "get_weather", "arguments": WEATHER}, {"name": "f", "arguments": {}}]
        )
        check("granite", text, None, [("get_weather", WEATHER), ("f", {})])
    check("granite", "No tool is needed: it is 4.", "No tool is needed: it is 4.", [])
    check("granite", "<|tool_call|>not json", "<|tool_call|>not json", [])
    assert get_tool_parser("granite").keeps_special_tokens


def test_phi4_mini_functools_array_after_text():
    text = 'Let me look. functools[{"name": "get_weather", "arguments": ' + json.dumps(TRICKY) + "}]"
    check("phi4_mini_json", text, "Let me look. ", [("get_weather", TRICKY)])
    check("phi4_mini_json", "functional programming", "functional programming", [])


def test_internlm_action_markers():
    call = json.dumps({"name": "get_weather", "parameters": WEATHER})
    text = f"I will check the weather.<|action_start|><|plugin|>\n{call}<|action_end|>\n"
    check("internlm", text, "I will check the weather.", [("get_weather", WEATHER)])
    assert get_tool_parser("internlm").keeps_special_tokens


def _deepseek(name: str, args: dict) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args)}\n```<｜tool▁call▁end｜>"


def test_deepseek_v3_calls_between_their_markers():
    calls = _deepseek("get_weather", WEATHER) + "\n" + _deepseek("lookup", TRICKY)
    text = f"Checking both.<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>"
    check("deepseek_v3", text, "Checking both.", [("get_weather", WEATHER), ("lookup", TRICKY)])
    broken = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\nnot a fence"
    check("deepseek_v3", broken, broken, [], streams_calls=False)
    assert get_tool_parser("deepseek_v3").keeps_special_tokens


def _qwen3_coder(name: str, params: dict) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_xml_parameters_become_json_arguments():
    params = {"city": "Paris, France", "days": "3", "filters": '{"rain": true}', "note": 'x < y & "z"'}
    text = "Sure.\n" + _qwen3_coder("get_weather", params) + "\n" + _qwen3_coder("now", {})
    expected = {"city": "Paris, France", "days": 3, "filters": {"rain": True}, "note": 'x < y & "z"'}
    check("qwen3_coder", text, "Sure.\n", [("get_weather", expected), ("now", {})])
    unfinished = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    check("qwen3_coder", unfinished, unfinished, [], streams_calls=False)


# round trip through each family's chat template

TOOLS = [WEATHER_TOOL]
ROME = {"city": "Rome", "days": 1}

# family: (template, parser, end of an assistant turn, how the call's arguments render, parallel calls)
FAMILIES = {
    "qwen2.5": (
        "hermes",
        "<|im_end|>\n",
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
        True,
    ),
    "llama3.1_json": (
        "llama3_json",
        "<|eot_id|>",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        False,
    ),
    "mistral_v0.3": (
        "mistral",
        "</s>",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "id": "abcDEF123"}',
        True,
    ),
    "llama3.2_pythonic": ("pythonic", "<|eot_id|>", '[get_weather(city="Paris", days=3)', True),
}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(300)


def _call(call_id: str, args: dict) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(args)},
    }


def _render(tokenizer, template: str, messages: list[dict], add_generation_prompt: bool) -> str:
    body = ChatCompletionRequest(
        model="m", messages=messages, tools=TOOLS, add_generation_prompt=add_generation_prompt
    )
    return render_chat_prompt(tokenizer, body, template, "auto")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_template_round_trip(tokenizer, family):
    parser_name, turn_end, rendered_call, parallel = FAMILIES[family]
    template = (TEMPLATES / f"{family}.jinja").read_text()
    user = {"role": "user", "content": "What is the weather in Paris?"}
    assistant = {"role": "assistant", "content": None, "tool_calls": [_call("abcDEF123", WEATHER)]}
    result = {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny, 21 C"}

    prompt = _render(tokenizer, template, [user, assistant, result], True)
    assert "get_weather" in prompt and "Current weather of a city" in prompt and '"required"' in prompt
    assert rendered_call in prompt
    assert "sunny, 21 C" in prompt

    calls = [_call("abcDEF123", WEATHER)] + ([_call("xyz789QRS", ROME)] if parallel else [])
    assistant = {"role": "assistant", "content": None, "tool_calls": calls}
    before = _render(tokenizer, template, [user], True)
    full = _render(tokenizer, template, [user, assistant], False)
    assert full.startswith(before) and full.endswith(turn_end)
    reply = full[len(before) : len(full) - len(turn_end)]

    content, parsed = get_tool_parser(parser_name)(None).extract_tool_calls(reply)
    assert content is None
    expected = [("get_weather", WEATHER)] + ([("get_weather", ROME)] if parallel else [])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == expected
    check(parser_name, reply, None, expected)


def test_qwen_round_trip_with_content(tokenizer):
    template = (TEMPLATES / "qwen2.5.jinja").read_text()
    user = {"role": "user", "content": "Weather?"}
    assistant = {"role": "assistant", "content": "Let me check.", "tool_calls": [_call("c1", WEATHER)]}
    before = _render(tokenizer, template, [user], True)
    full = _render(tokenizer, template, [user, assistant], False)
    content, calls = get_tool_parser("hermes")(None).extract_tool_calls(
        full[len(before) : -len("<|im_end|>\n")]
    )
    assert content.strip() == "Let me check."
    assert calls[0]["function"]["arguments"] == json.dumps(WEATHER)


def test_conversation_arguments_become_objects(tokenizer):
    template = (
        "{% for m in messages %}{{ m.role }}"
        "{% for c in m.tool_calls or [] %}|{{ c.function.arguments is mapping }}{% endfor %}"
        "|{{ m.tool_call_id }}|{{ m.content }}\n{% endfor %}"
    )
    bad = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    listed = {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1", WEATHER), bad, listed]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = ChatCompletionRequest(model="m", messages=messages)
    out = render_chat_prompt(tokenizer, body, template, "auto")
    assert out == "user||hi\nassistant|True|False|False||\ntool|c1|sunny\n"
    # the request itself is left as the client sent it
    assert body.messages[1].tool_calls[0]["function"]["arguments"] == json.dumps(WEATHER)
