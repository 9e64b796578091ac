"""DeepSeek-R1 and its distills."""

from __future__ import annotations

from jaxserve.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and the R1 distills (`deepseek_r1`).

    Newer R1 chat templates end the prompt with `<think>\\n`, so the output often starts straight
    in the reasoning with no start marker. The rule, as vLLM's:

    - text before `</think>` is reasoning, whether or not `<think>` opened it;
    - text after the first `</think>` is content (None when empty);
    - with no `</think>` at all the model has not finished thinking (cut at max_tokens, or still
      streaming), and the whole text is reasoning.
    """
