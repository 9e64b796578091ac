"""InternLM2 / 2.5 calls: {"name": ..., "parameters": {...}} between <|action_start|><|plugin|>
and <|action_end|> (special tokens), text may come before; the same scan as Hermes'."""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser


class InternLMToolParser(HermesToolParser):
    keeps_special_tokens = True
    start_marker = "<|action_start|><|plugin|>"
    end_marker = "<|action_end|>"
