"""Structured outputs and tools over HTTP, on the tiny random model: the OpenAI SDK's `parse`,
vLLM's request fields on both endpoints, streamed = non-streamed under a seed, and tool calls
that a grammar makes valid even though the model never learned to call tools."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_inputs import MODEL

from jaxserve.entrypoints.openai.chat_reply import ChatReply
from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser
from jaxserve.reasoning import get_reasoning_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },  # fmt: skip
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },  # fmt: skip
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


PET_SCHEMA = {**Pet.model_json_schema(), "additionalProperties": False}  # as strict mode sends it


async def test_openai_sdk_parse_returns_the_pydantic_model(sdk):
    c = await sdk()
    for seed in range(4):
        completion = await c.chat.completions.parse(
            model=MODEL, messages=USER, response_format=Pet, temperature=1.0, seed=seed, max_tokens=120,
            extra_body={"guided_whitespace_pattern": ""},
        )  # fmt: skip
        pet = completion.choices[0].message.parsed
        assert isinstance(pet, Pet) and completion.choices[0].finish_reason == "stop"


async def _stream_text(c: openai.AsyncOpenAI, **kwargs) -> tuple[str, str]:
    text, finish = "", None
    async for chunk in await c.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize(
    "extra",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True},
            }
        },  # fmt: skip
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"regex": "[a-z]{3,6}@[a-z]{2,5}\\.(com|org)"}},
        {"guided_choice": ["sunny", "rainy", "windy"]},
        {"guided_grammar": 'start: "x" ("+" "x")*'},
    ],
    ids=["json_schema", "json_object", "regex", "choice", "grammar"],
)
async def test_chat_streamed_equals_non_streamed_under_a_seed(sdk, extra):
    c = await sdk()
    kwargs = dict(model=MODEL, messages=USER, temperature=1.0, seed=11, max_tokens=80,
                  extra_body={**extra, "guided_whitespace_pattern": " ?"})  # fmt: skip
    whole = await c.chat.completions.create(**kwargs)
    text = whole.choices[0].message.content
    assert (text, whole.choices[0].finish_reason) == await _stream_text(c, **kwargs)
    if extra.get("response_format") == {"type": "json_object"}:
        return  # any object: a random model need not close it within max_tokens
    assert whole.choices[0].finish_reason == "stop", text
    if "response_format" in extra:
        Pet.model_validate(json.loads(text))
    elif "structured_outputs" in extra:
        assert re.fullmatch(extra["structured_outputs"]["regex"], text)
    elif "guided_choice" in extra:
        assert text in extra["guided_choice"]
    else:
        assert re.fullmatch(r"x(\+x)*", text)


async def test_completions_take_the_guided_fields_and_stream_the_same(http):
    session, url = http
    body = {"model": MODEL, "prompt": ["A date:", "Another:"], "n": 2, "temperature": 1.0, "seed": 3,
            "max_tokens": 30, "guided_regex": "20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"}  # fmt: skip
    async with session.post(url + "v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        whole = await r.json()
    texts = {c["index"]: c["text"] for c in whole["choices"]}
    assert len(texts) == 4 and all(re.fullmatch(body["guided_regex"], t) for t in texts.values())
    streamed: dict[int, str] = {}
    async with session.post(url + "v1/completions", json={**body, "stream": True}) as r:
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == texts


def _check_call(call) -> None:
    name, args = call.function.name, json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[name])
    assert call.type == "function" and call.id


@pytest.mark.parametrize("parallel", [True, False])
async def test_tool_choice_required_gives_valid_calls(sdk, parallel):
    c = await sdk()
    for seed in range(3):
        out = await c.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=seed,
            max_tokens=150, parallel_tool_calls=parallel, extra_body={"guided_whitespace_pattern": ""},
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
        for call in choice.message.tool_calls:
            _check_call(call)


async def test_named_tool_choice_streams_name_first_then_arguments(sdk):
    c = await sdk()
    kwargs = dict(model=MODEL, messages=USER, tools=[WEATHER, TIME], temperature=1.0, seed=5, max_tokens=100,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  extra_body={"guided_whitespace_pattern": ""})  # fmt: skip
    whole = (await c.chat.completions.create(**kwargs)).choices[0]
    assert whole.finish_reason == "stop" and [t.function.name for t in whole.message.tool_calls] == [
        "get_weather"
    ]
    _check_call(whole.message.tool_calls[0])
    name, args, ids = None, "", set()
    async for chunk in await c.chat.completions.create(stream=True, **kwargs):
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.function.name:
                assert name is None and not args  # the name comes first, once
                name = d.function.name
            ids.add(d.id) if d.id else None
            args += d.function.arguments or ""
    assert name == "get_weather" and len(ids) == 1
    assert args == whole.message.tool_calls[0].function.arguments


@pytest.mark.parametrize("parallel", [None, False])
async def test_auto_tool_choice_parses_the_models_own_format(sdk, parallel):
    """With --enable-auto-tool-choice and the hermes parser, a reply in Qwen's format (forced
    here by a regex, since the tiny model never learned it) comes back as tool calls; with
    parallel_tool_calls false, only the first of two."""
    c = await sdk(enable_auto_tool_choice=True, tool_call_parser="hermes")
    regex = '<tool_call>\n\\{"name": "get_time", "arguments": \\{"zone": "(UTC|CET)"\\}\\}\n</tool_call>'
    regex += (
        "" if parallel is None else "\n" + regex.replace("get_time", "get_weather").replace("zone", "city")
    )
    kwargs = dict(model=MODEL, messages=USER, tools=[WEATHER, TIME], temperature=1.0, seed=2, max_tokens=200,
                  parallel_tool_calls=parallel, extra_body={"structured_outputs": {"regex": regex}})  # fmt: skip
    whole = (await c.chat.completions.create(**kwargs)).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [call] = whole.message.tool_calls
    assert call.function.name == "get_time"
    _check_call(call)
    args, content = "", ""
    async for chunk in await c.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            content += delta.content or ""
            args += "".join(t.function.arguments or "" for t in delta.tool_calls or [])
    assert args == call.function.arguments and content == ""


@pytest.mark.parametrize(
    "body,words,param",
    [
        ({"tools": [WEATHER]}, ["--enable-auto-tool-choice"], "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            ["nope"],
            "tool_choice",
        ),
        ({"tool_choice": "required"}, ["needs tools"], "tool_choice"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, ["tools[0]"], "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, ["combined"], "tool_choice"),
        ({"response_format": {"type": "xml"}}, ["response_format"], "response_format"),
        ({"response_format": {"type": "json_schema"}}, ["json_schema"], "response_format"),
    ],
    ids=lambda v: None,
)
async def test_bad_tool_and_format_requests_are_400(http, body, words, param):
    session, url = http
    async with session.post(
        url + "v1/chat/completions", json={"model": MODEL, "messages": USER, **body}
    ) as r:
        error = await r.json()
        assert r.status == 400, error
    assert all(w in error["error"]["message"] for w in words), error
    assert error["error"]["param"] == param


class _ThinkTokenizer:
    """Just enough of a tokenizer for the reasoning parser: <think> and </think> are tokens."""

    def get_vocab(self):
        return {"<think>": 7, "</think>": 8}


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_reasoning_then_tool_calls_stream_as_the_whole_message(cut):
    """Qwen3's real output shape: reasoning, then the answer with a hermes tool call."""
    text = (
        "<think>\nThe user wants the weather; I should call get_weather.\n</think>\n\n"
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    )
    reply = ChatReply(
        get_reasoning_parser("qwen3")(_ThinkTokenizer()), False, get_tool_parser("hermes")(None)
    )
    fields, finish = reply.message(text, "stop")
    assert (
        fields["reasoning_content"]
        == fields["reasoning"]
        == "\nThe user wants the weather; I should call get_weather.\n"
    )
    assert fields["content"].strip() == "Let me check." and finish == "tool_calls"
    assert json.loads(fields["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    stream = reply.stream()
    got = {"reasoning_content": "", "content": "", "arguments": ""}
    ends = [*range(cut, len(text), cut), len(text)]
    for start, end in zip([0, *ends], ends):  # the text arrives in pieces, as a stream's deltas
        delta = stream.update(text[start:end], end == len(text))
        got["reasoning_content"] += delta.get("reasoning_content", "")
        got["content"] += delta.get("content", "")
        got["arguments"] += "".join(t["function"]["arguments"] for t in delta.get("tool_calls", []))
    assert got == {"reasoning_content": fields["reasoning_content"], "content": fields["content"],
                   "arguments": fields["tool_calls"][0]["function"]["arguments"]}  # fmt: skip
    assert stream.called


async def test_a_slow_grammar_compile_does_not_stall_other_requests(server, http, monkeypatch):
    """The server compiles a request's grammar on a worker thread: while one takes a second to
    compile (slowed down here), another request's stream keeps receiving tokens."""
    import asyncio
    import time

    engine = server.engine
    real = engine.check_structured_outputs
    compiling = {}

    def slow(params):
        compiling["start"] = time.monotonic()
        time.sleep(1.0)
        compiling["end"] = time.monotonic()
        return real(params)

    monkeypatch.setattr(engine, "check_structured_outputs", slow)
    session, url = http
    arrivals = []

    async def stream_other():
        while "start" not in compiling:  # stream while the other request's grammar compiles
            await asyncio.sleep(0.01)
        body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 30, "ignore_eos": True, "stream": True,
                "temperature": 0}  # fmt: skip
        async with session.post(url + "v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())

    async def constrained():
        body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "guided_regex": "[0-9]{3}"}
        async with session.post(url + "v1/completions", json=body) as r:
            assert r.status == 200
            assert re.fullmatch("[0-9]{3}", (await r.json())["choices"][0]["text"])

    await asyncio.gather(stream_other(), constrained())
    during = [t for t in arrivals if compiling["start"] < t < compiling["end"]]
    assert len(during) >= 3, (len(arrivals), compiling)
