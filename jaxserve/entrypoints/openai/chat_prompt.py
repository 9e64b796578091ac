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

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeChatRequest


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


def _text_parts(content: list[dict[str, Any]]) -> list[str]:
    texts = []
    for part in content:
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"message content parts of type {kind!r} are not supported; only 'text'.")
        texts.append(part["text"])
    return texts


def _template_tool_calls(tool_calls: Any) -> Any:
    """An assistant message's tool calls with each call's arguments as the object the templates
    read (`arguments | tojson`, or a loop over them), where the client sent it as a JSON string."""
    if not isinstance(tool_calls, list):
        return tool_calls
    calls = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        calls.append(call)
    return calls


def _conversation(body: ChatCompletionRequest | TokenizeChatRequest, content_format: str) -> list[dict]:
    """The messages with their content in the shape the template reads: clients send either
    a string or a list of text parts, and a template written for one breaks on the other.
    Tool calls' arguments come as JSON text and go to the template as objects; "tool" messages
    (content and tool_call_id) pass as they are."""
    conversation = []
    for m in body.messages:
        message = m.model_dump(exclude_none=True)
        if "tool_calls" in message:
            message["tool_calls"] = _template_tool_calls(message["tool_calls"])
        if isinstance(m.content, list):
            texts = _text_parts(m.content)
            if content_format == "string":
                message["content"] = "\n".join(texts)
            else:
                message["content"] = [{"type": "text", "text": t} for t in texts]
        elif isinstance(m.content, str) and content_format == "openai":
            message["content"] = [{"type": "text", "text": m.content}]
        conversation.append(message)
    return conversation


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
    conversation = _conversation(body, content_format)
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
