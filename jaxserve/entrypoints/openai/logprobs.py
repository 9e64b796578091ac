"""Logprobs in OpenAI's shapes, from the engine's per-token Logprob dicts.

Where it sits: at the end of the request flow, after the engine has produced outputs and
before the completion and chat handlers write their choices (or chunks). The two APIs ask
for different shapes of the same numbers (the completions API's parallel lists with text
offsets, the chat API's list of tokens with bytes and ranked alternatives, vLLM's
prompt_logprobs), and a streamed answer must add up to the plain one, so every shape is
made here from one notion of a token's text and bytes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from jaxserve.outputs import Logprob, RequestOutput

# OpenAI's stand-in for a log-probability too small to write (JSON has no -Infinity).
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), as char -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {b: chr(b) for b in kept}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class LogprobFormatter:
    """Holds the tokenizer (None with --skip-tokenizer-init) because a token the engine did
    not decode still needs a text, and a partial character needs its raw bytes."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def _decoded(self, token_id: int, logprob: Logprob | None) -> str | None:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def token_text(self, token_id: int, logprob: Logprob | None, as_ids: bool) -> str:
        """The token as the engine decoded it (a piece of an incomplete UTF-8 character shows
        as U+FFFD), or `token_id:N` (also when there is no tokenizer)."""
        text = None if as_ids else self._decoded(token_id, logprob)
        return f"token_id:{token_id}" if text is None else text

    def token_bytes(self, token_id: int, logprob: Logprob | None) -> list[int] | None:
        """The token's UTF-8 bytes. Where its text is an incomplete character: the raw bytes
        of a byte-level or byte-fallback token, else those of the text as decoded."""
        text = self._decoded(token_id, logprob)
        if text is None:
            return None
        if "\ufffd" in text and self.tokenizer is not None:
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(raw, str) and raw:
                match = _BYTE_FALLBACK.fullmatch(raw)
                if match:
                    return [int(match.group(1), 16)]
                if all(c in _BYTE_LEVEL for c in raw):
                    return [_BYTE_LEVEL[c] for c in raw]
        return list(text.encode("utf-8", errors="replace"))

    def completion_logprobs(
        self,
        token_ids: Sequence[int],
        entries: Sequence[dict[int, Logprob] | None],
        as_ids: bool,
        offset: int = 0,
    ) -> tuple[dict, int]:
        """The completions API's logprobs of these tokens, text offsets counted from `offset`
        in token texts; and the offset after the last one. `top_logprobs` holds every entry
        the engine gave: the chosen token and the top k. An entry of None (the first prompt
        token) has null logprobs."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=True):
            chosen = entry.get(token_id) if entry else None
            text = self.token_text(token_id, chosen, as_ids)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if chosen is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_finite(chosen.logprob))
            top: dict[str, float] = {}
            for t, lp in entry.items():
                top.setdefault(self.token_text(t, lp, as_ids), _finite(lp.logprob))
            top_logprobs.append(top)
        logprobs = {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top_logprobs,
        }
        return logprobs, offset

    def chat_logprobs(
        self, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None], top_k: int, as_ids: bool
    ) -> dict:
        """The chat API's logprobs of these tokens: each with its `top_k` most likely
        alternatives (by rank)."""

        def item(token_id: int, lp: Logprob | None) -> dict:
            return {
                "token": self.token_text(token_id, lp, as_ids),
                "logprob": _finite(lp.logprob) if lp is not None else MIN_LOGPROB,
                "bytes": self.token_bytes(token_id, lp),
            }

        content = []
        for k, token_id in enumerate(token_ids):
            entry = (entries[k] if k < len(entries) else None) or {}
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 62)
            top = [item(t, lp) for t, lp in ranked[:top_k]]
            content.append({**item(token_id, entry.get(token_id)), "top_logprobs": top})
        return {"content": content}


def prompt_logprobs(out: RequestOutput) -> list | None:
    """vLLM's prompt_logprobs field: null for the first prompt token, then per token
    {token_id: {"logprob", "rank", "decoded_token"}}."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            t: {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in out.prompt_logprobs
    ]
