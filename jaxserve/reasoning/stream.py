"""Incremental reasoning/content deltas for one streamed choice."""

from __future__ import annotations

from jaxserve.reasoning.base import ReasoningParser


class ReasoningStream:
    """Turns the cumulative text of one choice into reasoning and content deltas.

    `reasoning_ended=True` (the prompt already closed the thinking, e.g. Qwen3 with
    `enable_thinking=False`) makes every piece of text content, unparsed.
    """

    def __init__(self, parser: ReasoningParser, reasoning_ended: bool = False):
        self.parser = parser
        self.reasoning_ended = reasoning_ended
        self._reasoning = ""
        self._content = ""

    def update(self, text: str, final: bool) -> dict[str, str]:
        """The new parts since the last update: `reasoning_content` and `reasoning` (the same
        string) and/or `content`; {} when nothing is new. `text` is the whole output so far."""
        if self.reasoning_ended:
            reasoning, content = "", text
        else:
            reasoning, content = (part or "" for part in self.parser.split(text, final))
        delta: dict[str, str] = {}
        new_reasoning = _extension(self._reasoning, reasoning)
        if new_reasoning:
            delta["reasoning_content"] = delta["reasoning"] = new_reasoning
            self._reasoning = reasoning
        new_content = _extension(self._content, content)
        if new_content:
            delta["content"] = new_content
            self._content = content
        return delta


def _extension(sent: str, now: str) -> str:
    if not now.startswith(sent):
        raise ValueError("streamed text is not an extension of the text already split")
    return now[len(sent) :]
