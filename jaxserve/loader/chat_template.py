"""Chat templates rendered as transformers renders them, with jinja2 alone.

Where it sits: ``FastTokenizer.apply_chat_template`` (loader/fast_tokenizer.py) calls
`render_chat_template` for the tokenizers jaxserve builds itself (a GGUF file's), so that serving
such a model never imports transformers (about a second and a half of a start-up on a small CPU).
A Hugging Face directory's tokenizer is transformers' own and renders through it. The tests hold
the two renderers to the same output.

What a template sees is what transformers gives it: the messages as plain JSON data with keys
whose value is None dropped and the reasoning copied under its older names, ``tools``,
``documents``, ``add_generation_prompt``, the named special tokens and any extra variables; in
an immutable sandbox with ``tojson``, ``raise_exception`` and ``strftime_now``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Mapping
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning goes under; templates read the first, older ones the others.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Marks the end of a message to continue, so the rendering can be cut right after it.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-token masks in training) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names (no way to CPython internals)."""

    def __init__(*args, **kwargs):
        self, values = args[0], dict(*args[1:], **kwargs)
        for name in values:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the name {name!r}")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters, which changes what a model sees
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt),
        dict=lambda *args, **kwargs: dict(*args, **kwargs),
        namespace=_Namespace,
    )
    return env.from_string(template)


def plain_data(value: Any) -> Any:
    """`value` rebuilt from JSON types only (a template must not reach a rich object's methods);
    anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, bool, int, float):  # subclasses (enums, numpy scalars) back to the base type
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if isinstance(value, np.generic):  # np.bool_(False) would be a truthy placeholder
        return plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _message(message: Any) -> dict:
    message = plain_data(message)
    if not isinstance(message, dict):
        raise TypeError(
            f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}."
        )
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _tag_final_message(chat: list[dict], template: str, field: str) -> str:
    """Append the continue tag to the final message's `field` (its last text part, for a list);
    returns the text that must survive the rendering."""
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = (
        [f for f in _REASONING_FIELDS if chat[-1].get(f) == final] if field in _REASONING_FIELDS else [field]
    )
    if not any(f in template for f in fields):
        raise ValueError(
            f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template'
        )
    if isinstance(final, (list, tuple)):
        for part in reversed(final):
            if "text" in part:
                final, part["text"] = part["text"], part["text"] + _CONTINUE_TAG
                return final
        raise ValueError("continue_final_message is set but the final message has no text to continue!")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def render_chat_template(
    template: str,
    conversation: list,
    *,
    tools: list | None = None,
    documents: list | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **variables: Any,
) -> str:
    """One conversation as its prompt text. With `continue_final_message` the text ends with the
    final message itself (no end-of-turn after it), so the model continues that message."""
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible: the first continues "
            "the last message, the second starts a new assistant message."
        )
    if tools is not None and any(not isinstance(t, Mapping) for t in tools):
        raise ValueError("Tools should be JSON schemas (dicts).")
    if documents is not None and any(not isinstance(d, Mapping) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = [_message(m) for m in conversation]
    final = None
    if continue_final_message:
        if not chat:
            raise ValueError("continue_final_message is set but the conversation is empty!")
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _tag_final_message(chat, template, field)
    rendered = compile_chat_template(template).render(
        messages=chat,
        tools=plain_data(tools),
        documents=plain_data(documents),
        add_generation_prompt=add_generation_prompt,
        **plain_data(variables),
    )
    if final is not None:
        if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise ValueError(
                "continue_final_message is set but the final message does not appear in the chat after "
                "applying the chat template (the template drops part of it)."
            )
        at = rendered.rindex(_CONTINUE_TAG.strip())
        intact = rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG
        rendered = rendered[:at] if intact else rendered[:at].rstrip()
    return rendered
