"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat pipeline.

The request becomes a chat request (responses_protocol.py) and runs exactly as one; its reply
(reasoning, text, tool calls, as the chat endpoint's parsers split it) becomes output items:
`reasoning`, a `message` with one `output_text` part, one `function_call` per call. Streamed, the
same items arrive as OpenAI's typed events (`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ... `response.completed`),
each with its `sequence_number`. With `store` (the default), the conversation and the response
are kept in memory (the most recent MAX_STORED) for `previous_response_id` and for GET.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from jaxserve.entrypoints.openai.protocol import bad_request, now
from jaxserve.entrypoints.openai.responses_protocol import ResponsesRequest, input_messages
from jaxserve.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat, last_output
from jaxserve.entrypoints.openai.sse import sse_response

MAX_STORED = 1000


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """The most recent responses asked to be stored: id -> (conversation after it, response)."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (conversation, response)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[list[dict], dict] | None:
        return self._items.get(response_id)


def output_items(fields: dict[str, Any]) -> list[dict]:
    """The reply's fields (content, tool_calls, reasoning) as Responses output items."""
    items = []
    if fields.get("reasoning"):
        items.append(_reasoning_item(fields["reasoning"]))
    if fields.get("content"):
        items.append(_message_item(fields["content"]))
    for call in fields.get("tool_calls") or []:
        fn = call["function"]
        items.append(_call_item(call["id"], fn["name"], fn["arguments"]))
    return items


def _reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {
        "type": "reasoning",
        "id": item_id or _item_id("rs"),
        "summary": [],
        "content": content,
        "status": status,
    }


def _message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id or _item_id("msg"), "role": "assistant", "status": status,
            "content": [part]}  # fmt: skip


def _call_item(
    call_id: str, name: str, arguments: str, item_id: str | None = None, status: str = "completed"
) -> dict:
    return {"type": "function_call", "id": item_id or _item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def _assistant_message(items: list[dict]) -> dict:
    """The output items as the assistant message a next turn's template reads."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None):
        self.chat = chat
        self.store = store or ResponseStore()

    async def create(self, body: ResponsesRequest, raw: web.Request) -> web.StreamResponse:
        history: list[dict] = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id)
            if stored is None:
                raise bad_request(
                    f"Previous response with id {body.previous_response_id!r} not found.",
                    "previous_response_id",
                )
            history = stored[0]
        conversation = history + input_messages(body.input)
        run = await self.chat.start(body.to_chat(history), raw, "resp")
        if body.stream:
            return await sse_response(raw, self._events(body, run, conversation), named=True, done=False)
        final = await last_output(run.outputs)
        c = final.outputs[0]
        fields, _ = run.reply.message(c.text, c.finish_reason)
        usage = _usage(run.prompt_tokens, len(c.token_ids), final.num_cached_tokens)
        response = self._response(body, run, output_items(fields), c.finish_reason, usage)
        self._remember(body, response, conversation)
        return web.json_response(response)

    def retrieve(self, response_id: str) -> dict | None:
        stored = self.store.get(response_id)
        return None if stored is None else stored[1]

    def _remember(self, body: ResponsesRequest, response: dict, conversation: list[dict]) -> None:
        if body.store:
            self.store.put(response, [*conversation, _assistant_message(response["output"])])

    def _response(
        self, body: ResponsesRequest, run: ChatRun, output: list[dict], finish: str | None, usage: dict | None
    ) -> dict:
        """The Response object; `finish` None: still in progress."""
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        return {
            "id": run.request_id,
            "object": "response",
            "created_at": now(),
            "status": status,
            "model": run.model,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}},
            "reasoning": body.reasoning,
            "metadata": body.metadata or {},
            "store": body.store,
            "user": body.user,
        }

    async def _events(
        self, body: ResponsesRequest, run: ChatRun, conversation: list[dict]
    ) -> AsyncIterator[dict]:
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> dict:
            return {"type": kind, "sequence_number": next(sequence), **fields}

        start = self._response(body, run, [], None, None)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        items = _StreamedItems(event)
        stream = run.reply.stream()
        tokens, cached, finish = 0, 0, None
        async with contextlib.aclosing(run.outputs) as outputs:  # leaving early aborts the request
            async for _, out in outputs:
                c = out.outputs[0]
                finish = c.finish_reason
                tokens, cached = tokens + len(c.token_ids), out.num_cached_tokens
                for e in items.add(stream.update(c.text, finish is not None)):
                    yield e
        for e in items.close():
            yield e
        response = self._response(body, run, items.done, finish, _usage(run.prompt_tokens, tokens, cached))
        self._remember(body, response, conversation)
        yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                    response=response)  # fmt: skip


class _StreamedItems:
    """The output items of a streamed reply, opened and closed as its deltas come: one item is
    open at a time, and a delta of another kind (or another call) closes it."""

    def __init__(self, event):
        self.event = event
        self.done: list[dict] = []
        self.open: dict | None = None
        self.text = ""  # the open item's text (or arguments) so far

    def add(self, delta: dict) -> list[dict]:
        events = []
        reasoning = delta.get("reasoning_content")
        if reasoning:
            events += self._switch("reasoning") + [
                self._text_delta("response.reasoning_text.delta", reasoning)
            ]
        if delta.get("content"):
            events += self._switch("message") + [
                self._text_delta("response.output_text.delta", delta["content"])
            ]
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a new call: its name comes first
                events += self._close() + self._open(_call_item(call["id"], call["function"]["name"], "",
                                                                _item_id("fc"), "in_progress"))  # fmt: skip
            args = call["function"].get("arguments")
            if args:
                events.append(self._text_delta("response.function_call_arguments.delta", args))
        return events

    def close(self) -> list[dict]:
        return self._close()

    def _switch(self, kind: str) -> list[dict]:
        if self.open is not None and self.open["type"] == kind:
            return []
        make = _reasoning_item if kind == "reasoning" else _message_item
        return self._close() + self._open(
            make("", _item_id("rs" if kind == "reasoning" else "msg"), "in_progress")
        )

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.done)}

    def _text_delta(self, kind: str, text: str) -> dict:
        self.text += text
        part = {} if self.open["type"] == "function_call" else {"content_index": 0}
        return self.event(kind, **self._where(), **part, delta=text)

    def _open(self, item: dict) -> list[dict]:
        self.open, self.text = item, ""
        events = [self.event("response.output_item.added", output_index=len(self.done), item=item)]
        if item["type"] != "function_call":
            part = dict(item["content"][0])
            events.append(
                self.event("response.content_part.added", **self._where(), content_index=0, part=part)
            )
        return events

    def _close(self) -> list[dict]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        if item["type"] == "function_call":
            item = {**item, "arguments": self.text, "status": "completed"}
            events = [self.event("response.function_call_arguments.done", **where, arguments=self.text)]
        else:
            part = {**item["content"][0], "text": self.text}
            item = {**item, "content": [part], "status": "completed"}
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            events = [
                self.event(f"response.{kind}.done", **where, content_index=0, text=self.text),
                self.event("response.content_part.done", **where, content_index=0, part=part),
            ]
        events.append(self.event("response.output_item.done", output_index=len(self.done), item=item))
        self.done.append(item)
        self.open = None
        return events


def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }
