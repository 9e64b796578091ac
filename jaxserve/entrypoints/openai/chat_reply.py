"""From generated text to an assistant message: the reasoning split off first (--reasoning-parser),
then the tool calls found in what remains (chat_tools.py). `message` shapes a finished reply;
`ChatReplyStream` the deltas of a streamed one, whose pieces add up to the same message.
"""

from __future__ import annotations

from typing import Any

from jaxserve.entrypoints.openai.tool_parsers.base import ToolCallStream, ToolParser
from jaxserve.reasoning import ReasoningParser, ReasoningStream


class ChatReply:
    def __init__(
        self,
        reasoning: ReasoningParser | None = None,
        reasoning_ended: bool = False,  # the prompt already closed the thinking: all text is content
        tools: ToolParser | None = None,
        forced_function: bool = False,  # tool_choice named a function: OpenAI's finish_reason stays "stop"
    ):
        self.reasoning = reasoning
        self.reasoning_ended = reasoning_ended
        self.tools = tools
        self.forced_function = forced_function

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and reason == "stop" and not self.forced_function else reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the message's content, tool_calls and reasoning fields, the finish reason)."""
        reasoning, content = None, text
        if self.reasoning is not None and not self.reasoning_ended:
            reasoning, content = self.reasoning.split(text, final=True)
        calls: list[dict] = []
        if self.tools is not None and content is not None:
            content, calls = self.tools.extract_tool_calls(content)
        fields: dict[str, Any] = {"content": content, "tool_calls": calls}
        if self.reasoning is not None:
            fields["reasoning_content"] = fields["reasoning"] = reasoning
        return fields, self.finish_reason(finish_reason, bool(calls))

    def stream(self) -> ChatReplyStream:
        return ChatReplyStream(self)


class ChatReplyStream:
    """One streamed choice: each update takes the text generated since the last and gives the
    delta fields. Plain text passes straight through; a reasoning or tool parser reads the
    whole text so far (its cost per update grows with it)."""

    def __init__(self, reply: ChatReply):
        self.reply = reply
        self._reasoning = (
            ReasoningStream(reply.reasoning, reply.reasoning_ended) if reply.reasoning is not None else None
        )
        self._tools = ToolCallStream(reply.tools) if reply.tools is not None else None
        self._text = ""  # all text so far, kept only for the reasoning parser
        self._content = ""  # all content so far, kept only for the tool parser

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.has_calls

    def update(self, new_text: str, final: bool) -> dict[str, Any]:
        if self._reasoning is not None:
            self._text += new_text
            delta = self._reasoning.update(self._text, final)
            new_content = delta.pop("content", "")
        else:
            delta, new_content = {}, new_text
        if self._tools is not None:
            self._content += new_content
            delta.update(self._tools.update(self._content, final))
        elif new_content:
            delta["content"] = new_content
        return delta
