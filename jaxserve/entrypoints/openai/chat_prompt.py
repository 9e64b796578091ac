"""A chat request's messages as the prompt text the model was trained on.

Where it sits: at the start of a chat completion (and of /tokenize with messages), after
protocol.py has validated the body and before the prompt is tokenized. Which template
applies (the request's, --chat-template, or the tokenizer's own) and what shape the
template expects a message's content in (a string, or OpenAI's list of parts) are
decided here; the Jinja rendering itself is the tokenizer's (transformers', or
jaxserve/loader/chat_template.py for the tokenizers jaxserve builds itself). A template
that fails on the messages is the client's mistake, so it comes back as a ValueError (a 400).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, TokenizeChatRequest


def load_chat_template(value: str | None) -> str | None:
    """--chat-template / the chat_template field: a file path, or the Jinja text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat template {value!r} is neither a readable file nor a Jinja template.")


def server_chat_template(value: str | None, tokenizer: Any) -> str | None:
    """--chat-template wins over the tokenizer's own, so a checkpoint whose template is
    missing or wrong can still be served."""
    template = load_chat_template(value)
    if template is None and tokenizer is not None:
        template = getattr(tokenizer, "chat_template", None)
    return template


# A template that loops over a message's content expects OpenAI's list of parts.
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")


def detect_content_format(template: str | None) -> str:
    return "openai" if template and _LOOPS_OVER_CONTENT.search(template) else "string"


def _texts(content: str | list[dict[str, Any]] | None) -> list[str]:
    """A message's text, whatever shape the client sent it in: no content (an assistant turn
    that only calls tools) is no text; a string is one; a list holds OpenAI's text parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts = []
    for part in content:
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"message content parts of type {kind!r} are not supported; only 'text'.")
        texts.append(part["text"])
    return texts


def _template_tool_calls(tool_calls: list) -> list:
    """An assistant message's tool calls with each call's arguments as the object the templates
    read (`arguments | tojson`, or a loop over them), where the client sent it as a JSON string;
    no arguments at all read as an empty object."""
    calls = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            arguments = function.get("arguments")
            if not arguments:
                call = {**call, "function": {**function, "arguments": {}}}
            elif isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    call = {**call, "function": {**function, "arguments": parsed}}
        calls.append(call)
    return calls


def _template_message(m: ChatMessage, content_format: str) -> dict[str, Any]:
    """One message as vLLM hands it to a template: content always present (a string, or a list
    of text parts for templates that loop over parts; empty when the client sent none), an
    assistant's `tool_calls` (arguments as objects) and reasoning (under both names templates
    read), a tool result's `tool_call_id`, and `name`. Other fields stay out of the prompt."""
    texts = _texts(m.content)
    content: str | list = (
        "\n".join(texts) if content_format == "string" else [{"type": "text", "text": t} for t in texts]
    )
    message: dict[str, Any] = {"role": m.role, "content": content}
    extra = m.model_extra or {}
    if m.role == "assistant":
        if isinstance(extra.get("tool_calls"), list):
            message["tool_calls"] = _template_tool_calls(extra["tool_calls"])
        reasoning = extra.get("reasoning") or extra.get("reasoning_content")
        if isinstance(reasoning, str):
            message["reasoning"] = message["reasoning_content"] = reasoning
    elif m.role == "tool" and extra.get("tool_call_id") is not None:
        message["tool_call_id"] = extra["tool_call_id"]
    if isinstance(m.name, str):
        message["name"] = m.name
    return message


def render_chat_prompt(
    tokenizer: Any,
    body: ChatCompletionRequest | TokenizeChatRequest,
    server_template: str | None,
    content_format: str,
) -> str:
    """The conversation as the prompt text the chat template makes of it. The request's own
    chat_template wins over `server_template`; `content_format` is
    --chat-template-content-format ("auto" looks at the template)."""
    template = load_chat_template(body.chat_template) or server_template
    if template is None:
        raise ValueError(
            "The model has no chat template and none was given (--chat-template or chat_template)."
        )
    if content_format == "auto":
        content_format = detect_content_format(template)
    conversation = [_template_message(m, content_format) for m in body.messages]
    kwargs = dict(body.chat_template_kwargs or {})
    if getattr(body, "tools", None):
        kwargs["tools"] = body.tools
    try:
        return tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except Exception as e:  # a template error is about the request's messages
        raise ValueError(f"The chat template failed on these messages: {e}") from None
