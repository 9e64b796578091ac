"""IBM Granite 3.2+ with thinking on (`granite`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxserve.reasoning.base import ReasoningParser

THOUGHT = ("Here is my thought process:", "Here's my thought process:")
RESPONSE = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser(ReasoningParser):
    """Granite writes its thinking as plain text, not special tokens: "Here is my thought
    process:" (or "Here's ...") opens it and "Here is my response:" opens the answer. An output
    that does not open with the first phrase is all content (thinking is off unless the request
    asks for it, `chat_template_kwargs: {"thinking": true}`); one that does is reasoning until the
    second phrase, then content. With no end token, a structured-output constraint applies from
    the first token (the grammar cannot tell where the thought ends).
    """

    def __init__(self, tokenizer: Any = None):
        self.start_token_id = self.end_token_id = None

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        body = text.lstrip()
        opened = next((m for m in THOUGHT if body.startswith(m)), None)
        if opened is None:
            if not final and any(m.startswith(body) for m in THOUGHT):
                return None, None  # may still open the thought
            return None, text or None
        rest = body[len(opened) :]
        found = [(k, m) for m in RESPONSE if (k := rest.find(m)) >= 0]
        if found:
            k, marker = min(found)
            return rest[:k] or None, rest[k + len(marker) :] or None
        if not final:
            rest = rest[: len(rest) - _partial(rest)]
        return rest or None, None

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        return False

    def content_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        return []


def _partial(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a response phrase."""
    for n in range(min(len(text), max(map(len, RESPONSE)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in RESPONSE):
            return n
    return 0
