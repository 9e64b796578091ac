"""Qwen3, Qwen3 thinking-2507 and later Qwen releases."""

from __future__ import annotations

from jaxserve.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (`qwen3`).

    Hybrid Qwen3 models write `<think>` themselves when thinking; the thinking-2507 models and
    later templates put `<think>\\n` at the end of the prompt, so the output holds only
    `</think>`. Both styles split the same way, as vLLM's current qwen3 parser does:

    - a `<think>` in the output is dropped; text before the first `</think>` is reasoning,
      text after it is content (None when empty);
    - with no `</think>` the thinking was cut short (max_tokens) or is still streaming, and the
      whole text is reasoning, not content.

    With thinking disabled (`enable_thinking=False`) the template renders
    `<think>\\n\\n</think>\\n\\n` into the prompt and the output has no markers. Text alone cannot
    tell that apart from an unfinished thought, so the caller decides it from the prompt:
    `is_reasoning_end(prompt_token_ids)` is then True, and a `ReasoningStream` made with
    `reasoning_ended=True` passes the whole output through as content (vLLM routes it the same
    way from its prompt check and the request's `enable_thinking`).
    """
