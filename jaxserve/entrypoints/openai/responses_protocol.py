"""OpenAI's Responses API request (`POST /v1/responses`), read as the chat request it amounts to.

Where it sits: between the route and the chat pipeline. A Responses request is a conversation in
another shape: `instructions` (a system message), `input` (a string, or items: messages,
`function_call`s the model made, `function_call_output`s the client sends back, `reasoning`),
flat function `tools`, `text.format` for structured output, `max_output_tokens`. `to_chat` turns
it, after the conversation a `previous_response_id` names, into a ChatCompletionRequest, so the
template, tools, grammars and parsers are the chat endpoint's own.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from jaxserve.entrypoints.openai.protocol import _INT64, ChatCompletionRequest, OpenAIBaseModel, bad_request

# Message content parts that carry text, by the names the Responses API gives them.
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=-_INT64 - 1, le=_INT64)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    request_id: str | None = None
    # vLLM's extra sampling fields most used with this API
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False

    def to_chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request of this one, after `history` (the messages of the conversation a
        previous_response_id names; its instructions are not carried over, as OpenAI does)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += history + input_messages(self.input)
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": _response_format(self.text),
        }
        for name in ("temperature", "top_p", "seed", "user", "request_id", "top_k", "min_p",
                     "repetition_penalty", "ignore_eos"):  # fmt: skip
            fields[name] = getattr(self, name)
        if self.tools:
            fields["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.stream:
            fields["stream_options"] = {"include_usage": True}
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of the request's `input`: a string is one user message; of the items,
    consecutive function calls make one assistant message, each output a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": _role(item, i), "content": _content(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", i), "type": "function",
                    "function": {"name": _text(item, "name", i), "arguments": _text(item, "arguments", i)}}  # fmt: skip
            last = messages[-1] if messages else None
            if (
                last is not None
                and last["role"] == "assistant"
                and last.get("tool_calls")
                and not last["content"]
            ):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item, "output", i)
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", i), "content": output})
        elif kind == "reasoning":
            continue  # the model's earlier thinking: templates drop it from past turns
        else:
            raise bad_request(f"input[{i}]: items of type {kind!r} are not supported.", "input")
    return messages


def _role(item: dict[str, Any], i: int) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"input[{i}].role must be user, assistant, system or developer.", "input")
    return "system" if role == "developer" else role


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].content must be a string or a list of parts.", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"input[{i}].content: parts of type {kind!r} are not supported; only text.", "input"
            )
        texts.append(part["text"])
    return "".join(texts)


def _text(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}].{key} must be a string.", "input")
    return value


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    """A Responses function tool ({"type", "name", "parameters", ...}) as a chat tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(
            f"tools[{i}]: only function tools with a name are supported, got {kind!r}.", "tools"
        )
    function = {
        k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
    }
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat request's response_format."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object.", "text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return fmt
