"""GLM-4.5 / 4.6 (`glm45`)."""

from __future__ import annotations

from jaxserve.reasoning.base import ReasoningParser


class Glm45ReasoningParser(ReasoningParser):
    """GLM-4.5 writes `<think>` itself when it thinks; with thinking off (`/nothink`, or
    `enable_thinking: false`) its template puts an empty `<think></think>` into the prompt and
    the output is the answer alone. So, unlike R1's: text before `</think>` is reasoning; with
    no `</think>`, an output that opened with `<think>` is an unfinished thought (reasoning),
    and any other output is all content.
    """

    def _unterminated(self, text: str, final: bool) -> tuple[str, str]:
        if text.lstrip().startswith(self.start_marker):
            return text, ""
        return "", text
