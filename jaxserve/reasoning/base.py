"""The common part of the reasoning parsers: marker ids, the token-id checks and the text split."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any


class ReasoningParser:
    """Splits a thinking model's output into reasoning and content.

    The reasoning sits between `start_marker` and `end_marker`. `split` works on the cumulative
    decoded text and is a pure function of it, so one parser serves every request; per-choice
    streaming state lives in `ReasoningStream`. Subclasses decide what text without an end marker
    is (`_unterminated`).
    """

    start_marker = "<think>"
    end_marker = "</think>"

    def __init__(self, tokenizer: Any = None):
        self.start_token_id = _token_id(tokenizer, self.start_marker)
        self.end_token_id = _token_id(tokenizer, self.end_marker)
        if tokenizer is not None and self.end_token_id is None:
            raise ValueError(
                f"the {type(self).__name__} reasoning parser needs {self.end_marker!r} to be a "
                "single token of the tokenizer, and this tokenizer has no such token"
            )
        markers = sorted({self.start_marker, self.end_marker}, key=len, reverse=True)
        self._marker_re = re.compile("|".join(re.escape(m) for m in markers))

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of the generated text so far; None for an empty part.

        Text before the first end marker is reasoning (what that means without any end marker is
        the subclass's `_unterminated`), text after it is content, and no marker appears in either
        part. While not final, a trailing partial marker belongs to neither part yet, so for t1 a
        prefix of t2 the parts of split(t1, False) are prefixes of those of split(t2, ...).
        """
        if not final:
            text = text[: len(text) - self._partial_marker_len(text)]
        head, found, tail = text.partition(self.end_marker)
        if found:
            reasoning, content = head, tail
        else:
            reasoning, content = self._unterminated(text, final)
        return self._clean(reasoning), self._clean(content)

    def _unterminated(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of text that holds no end marker: all reasoning by default."""
        return text, ""

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the thinking is over: scanning back, an end marker comes before a start one."""
        if self.end_token_id is None:
            return False
        for token_id in reversed(token_ids):
            if token_id == self.end_token_id:
                return True
            if token_id == self.start_token_id:
                return False
        return False

    def content_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The ids after the last end marker; [] when there is none."""
        ids = list(token_ids)
        if self.end_token_id is None or self.end_token_id not in ids:
            return []
        last = len(ids) - 1 - ids[::-1].index(self.end_token_id)
        return ids[last + 1 :]

    def _partial_marker_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a marker."""
        longest = max(len(self.start_marker), len(self.end_marker)) - 1
        for n in range(min(longest, len(text)), 0, -1):
            tail = text[-n:]
            if any(m.startswith(tail) and m != tail for m in (self.start_marker, self.end_marker)):
                return n
        return 0

    def _clean(self, part: str) -> str | None:
        return self._marker_re.sub("", part) or None


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` as one token of the tokenizer's vocabulary, or None."""
    if tokenizer is None:
        return None
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is not None:
        token_id = get_vocab().get(token)
        return None if token_id is None else int(token_id)
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
        return None
    return int(token_id)
