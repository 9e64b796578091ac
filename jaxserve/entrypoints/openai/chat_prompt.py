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


def _parts(content: str | list[dict[str, Any]] | None) -> list[str | None]:
    """A message's parts, whatever shape the client sent it in: its texts, and None where an
    image stands. No content (an assistant turn that only calls tools) has none; a string is one
    text; a list holds OpenAI's text and image_url parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "image_url":
            image_url(part)
            parts.append(None)
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise ValueError(
                f"message content parts of type {kind!r} are not supported; only 'text' and 'image_url'."
            )
    return parts


def image_url(part: dict[str, Any]) -> str:
    """An image_url part's URL ({"url": ...}, or the URL alone as some clients send it)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError("an image_url content part needs image_url.url: a data:, file:// or http(s) URL.")
    return url


def chat_image_urls(body: ChatCompletionRequest | TokenizeChatRequest) -> list[str]:
    """The URLs of the conversation's images, in the order the prompt shows them."""
    return [
        image_url(part)
        for m in body.messages
        if isinstance(m.content, list)
        for part in m.content
        if part.get("type") == "image_url"
    ]


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


def _template_message(m: ChatMessage, content_format: str, placeholder: str | None) -> dict[str, Any]:
    """One message as vLLM hands it to a template: content always present (a string, or a list
    of parts for templates that loop over parts: texts, and {"type": "image"} where an image
    stands; empty when the client sent none), an assistant's `tool_calls` (arguments as objects)
    and reasoning (under both names templates read), a tool result's `tool_call_id`, and `name`.
    Other fields stay out of the prompt. In a string, a message's images are the model's
    placeholders, each on a line before its text."""
    parts = _parts(m.content)
    if None in parts and placeholder is None:
        raise ValueError("This model takes no images: send text content only.")
    content: str | list
    if content_format == "string":
        content = "\n".join([placeholder] * parts.count(None) + [t for t in parts if t is not None])
    else:
        content = [{"type": "image"} if t is None else {"type": "text", "text": t} for t in parts]
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
    image_placeholder: str | None = None,
) -> str:
    """The conversation as the prompt text the chat template makes of it. The request's own
    chat_template wins over `server_template`; `content_format` is
    --chat-template-content-format ("auto" looks at the template); `image_placeholder`: what
    stands for an image in a string content (None: the model takes no images)."""
    template = load_chat_template(body.chat_template) or server_template
    if template is None:
        raise ValueError(
            "The model has no chat template and none was given (--chat-template or chat_template)."
        )
    if content_format == "auto":
        content_format = detect_content_format(template)
    conversation = [_template_message(m, content_format, image_placeholder) for m in body.messages]
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
