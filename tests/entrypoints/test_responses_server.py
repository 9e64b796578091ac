"""POST /v1/responses through the OpenAI SDK (`client.responses.create`), on the tiny random
model: the same tokens as the chat request it amounts to, streamed events that add up to the
response, function calls and their outputs across turns by previous_response_id, and 400s for
what it cannot serve."""

from __future__ import annotations

import json

import openai
import pytest
from aiohttp import ClientSession
from server_inputs import MODEL
from tool_schemas import TIME as CHAT_TIME
from tool_schemas import flat

TIME = flat(CHAT_TIME)


async def _prompt_tokens(client: openai.AsyncOpenAI, messages: list[dict], tools: list | None = None) -> int:
    body = {"model": MODEL, "messages": messages, **({"tools": tools} if tools else {})}
    async with ClientSession() as http:
        async with http.post(str(client.base_url).removesuffix("v1/") + "tokenize", json=body) as r:
            return (await r.json())["count"]


async def test_a_response_is_the_chat_completion_of_its_input(sdk):
    c = await sdk()
    resp = await c.responses.create(
        model=MODEL, instructions="Be brief.", input="Tell me a story.", max_output_tokens=6, temperature=0
    )
    chat = await c.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}],
    )  # fmt: skip
    assert resp.object == "response" and resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens and resp.usage.output_tokens == 6
    assert resp.usage.total_tokens == resp.usage.input_tokens + 6
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert (await c.responses.retrieve(resp.id)).output_text == resp.output_text


async def test_streamed_events_add_up_to_the_response(sdk):
    c = await sdk()
    kwargs = dict(
        model=MODEL,
        input="Once upon a time",
        max_output_tokens=12,
        temperature=1.0,
        extra_body={"seed": 4, "ignore_eos": True},
    )
    whole = await c.responses.create(**kwargs)
    events = [e async for e in await c.responses.create(stream=True, **kwargs)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 12


@pytest.mark.parametrize("stream", [False, True])
async def test_a_function_call_and_its_output_across_two_turns(sdk, stream):
    c = await sdk()
    question = "What time is it in Zurich?"
    kwargs = dict(model=MODEL, input=question, tools=[TIME], tool_choice="required", temperature=1.0, extra_body={"seed": 3},
                  max_output_tokens=60, parallel_tool_calls=False)  # fmt: skip
    if stream:
        events = [e async for e in await c.responses.create(stream=True, **kwargs)]
        first = events[-1].response
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert args == first.output[0].arguments
    else:
        first = await c.responses.create(**kwargs)
    [call] = first.output
    assert first.status == "completed" and call.type == "function_call" and call.name == "get_time"
    zone = json.loads(call.arguments)["zone"]

    second = await c.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[TIME], tool_choice="none", max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": f"14:05 {zone}"}],
    )  # fmt: skip
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    as_chat = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_time", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": f"14:05 {zone}"},
    ]  # fmt: skip
    assert second.usage.input_tokens == await _prompt_tokens(c, as_chat, [CHAT_TIME])

    # statelessly, as agents with store=False run: the first output items sent back as input
    items = [{"role": "user", "content": question}, *first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": f"14:05 {zone}"})
    again = await c.responses.create(
        model=MODEL, input=items, tools=[TIME], tool_choice="none", max_output_tokens=4, store=False
    )
    assert again.usage.input_tokens == second.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(again.id)


async def test_input_items_and_a_json_schema_format(sdk):
    c = await sdk()
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    items = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Is it "}, {"type": "input_text", "text": "ok?"}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Maybe."}]},
        {"role": "developer", "content": "Answer in JSON."},
    ]
    resp = await c.responses.create(
        model=MODEL, input=items, temperature=1.0, extra_body={"seed": 1}, max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert resp.status == "completed" and set(json.loads(resp.output_text)) == {"ok"}
    as_chat = [{"role": "user", "content": "Is it ok?"}, {"role": "assistant", "content": "Maybe."},
               {"role": "system", "content": "Answer in JSON."}]  # fmt: skip
    assert resp.usage.input_tokens == await _prompt_tokens(c, as_chat)


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": 3, "output": "x"}]}, "input"),
        ({"input": "hi", "text": {"format": "json"}}, "text"),
    ],
)
async def test_what_cannot_be_served_is_a_400_naming_its_field(sdk, fields, param):
    c = await sdk()
    with pytest.raises(openai.BadRequestError) as e:
        await c.responses.create(model=MODEL, **fields)
    assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve("resp_nope")


def test_streamed_items_open_and_close_in_order_and_match_the_whole_reply():
    """A reply's deltas (reasoning, then text, then two calls) as events: one item open at a time,
    each closed by its done events before the next opens, and the items at the end are the ones
    the whole reply gives."""
    from jaxserve.entrypoints.openai.serving_responses import _StreamedItems, output_items

    sequence = iter(range(1000))
    items = _StreamedItems(lambda kind, **f: {"type": kind, "sequence_number": next(sequence), **f})
    call = {"type": "function", "function": {"name": "get_time", "arguments": ""}}
    deltas = [
        {"reasoning_content": "Zurich is ", "reasoning": "Zurich is "},
        {"reasoning_content": "in CET.", "reasoning": "in CET."},
        {"content": "Checking."},
        {
            "tool_calls": [
                {"index": 0, "id": "c1", **call},
                {"index": 0, "function": {"arguments": '{"zone": '}},
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '"CET"}'}}, {"index": 1, "id": "c2", **call}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
    ]
    events = [e for d in deltas for e in items.add(d)] + items.close()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == [0, 1, 2, 3]
    for index in range(4):  # every event of an item lies between its added and its done
        spans = [i for i, e in enumerate(events) if e.get("output_index") == index]
        assert events[spans[0]]["type"] == "response.output_item.added"
        assert events[spans[-1]]["type"] == "response.output_item.done"
        assert spans == list(range(spans[0], spans[-1] + 1))
    whole = output_items({
        "reasoning": "Zurich is in CET.",
        "content": "Checking.",
        "tool_calls": [{"id": "c1", **{**call, "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}},
                       {"id": "c2", **{**call, "function": {"name": "get_time", "arguments": "{}"}}}],
    })  # fmt: skip
    strip = lambda items: [{k: v for k, v in i.items() if k != "id"} for i in items]  # noqa: E731
    assert strip(items.done) == strip(whole)
    texts = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert texts == ["Zurich is ", "in CET."]
