"""Incremental detokenization and stop strings, one instance per request.

The OutputProcessor feeds each request's new token ids here after Scheduler.update(); the
text goes to the request's stream. A stop string found here is handed to the Scheduler, which
finishes the request (Scheduler.stop_on_strings).

Decoding tokens one at a time is wrong for most tokenizers (a space-marker token decodes
differently at the start of a string, a character can span several byte tokens), and
decoding the whole output every step is O(n^2). vLLM's answer, used here: decode a small
window twice, with and without the new tokens, and emit the difference. The window
starts at prefix_offset (a few tokens of already-emitted context, so leading-space rules
see what they would see in the full text) and read_offset marks where unemitted tokens
begin. Offsets only move forward once the new text is complete: a window ending in
U+FFFD is the front of an unfinished UTF-8 sequence and waits for its next byte.
"""

from __future__ import annotations

from typing import Any

from jaxserve.engine.request import Request

# Prompt tokens kept as left context for the first output tokens (vLLM's value).
_INITIAL_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, request: Request) -> None:
        params = request.sampling_params
        self.tokenizer = tokenizer
        self.stop: list[str] = list(params.stop or ())
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._decode_kwargs = {
            "skip_special_tokens": params.skip_special_tokens,
            "clean_up_tokenization_spaces": False,
        }
        if not getattr(tokenizer, "is_fast", True):
            # Only slow tokenizers implement it; fast ones join special tokens as their
            # decoder does (vLLM behaves the same).
            self._decode_kwargs["spaces_between_special_tokens"] = params.spaces_between_special_tokens
        # Streamed text stops short of a possible stop string's beginning, so that a stop
        # string completed by a later token is never shown. Kept text needs no hold-back.
        if self.stop and not self.include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0

        # Token ids of the decode window's world: the tail of the prompt, then the output.
        # Two extra prompt tokens in case some of the context is skipped special tokens.
        # (a prompt given as embeddings has no tokens to read: its ids are placeholders)
        context = request.prompt_token_ids[-(_INITIAL_OFFSET + 2) :] if request.prompt_embeds is None else []
        self._ids: list[int] = list(context)
        self._read_offset = len(context)
        self._prefix_offset = max(self._read_offset - _INITIAL_OFFSET, 0)
        self.num_output_tokens = 0
        self._text = ""
        self._last_delta_offset = 0
        self.stop_string: str | None = None

    @property
    def output_text(self) -> str:
        return self._text

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Add tokens; return the stop string if one now appears in the output (the text is
        then already truncated, and num_output_tokens counts the tokens up to the one that
        completed it), else None.

        stop_terminated: the request just finished on eos or a stop token id, the last of
        new_token_ids. As in vLLM that token's text is left out unless
        include_stop_str_in_output.
        """
        if self.stop_string is not None or not new_token_ids:
            return None
        if len(new_token_ids) > 1 and self.stop:  # a stop string may end before the last of them
            last = len(new_token_ids) - 1
            for i, token_id in enumerate(new_token_ids):
                stop = self._update([token_id], stop_terminated and i == last)
                if stop is not None:
                    return stop  # (num_output_tokens: the tokens up to the one that completed it)
            return None
        return self._update(new_token_ids, stop_terminated)

    def _update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        self.num_output_tokens += len(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        len_before = len(self._text)
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self._text += self._decode_next()
        # As vLLM does, stop strings are only honoured once min_tokens tokens are out.
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        found = self._find_stop(len(self._text) - len_before)
        if found is not None:
            self.stop_string, end = found
            self._text = self._text[:end]
        return self.stop_string

    def _decode_next(self) -> str:
        window = self._ids[self._prefix_offset :]
        prefix_text = self.tokenizer.decode(
            window[: self._read_offset - self._prefix_offset], **self._decode_kwargs
        )
        new_text = self.tokenizer.decode(window, **self._decode_kwargs)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet (a skipped special token, or half a character)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _find_stop(self, num_new_chars: int) -> tuple[str, int] | None:
        """Earliest stop string that ends in the new text, and where to cut the output.

        Earlier text was searched on earlier calls, so a match must end among the new
        characters: the search starts len(stop) - 1 characters before them. When several
        stop strings match, the one that starts first wins, because the model produced it
        first.
        """
        if num_new_chars <= 0:
            return None
        best: tuple[int, str] | None = None
        text = self._text
        for stop in self.stop:
            index = text.find(stop, max(len(text) - num_new_chars - len(stop) + 1, 0))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        return stop, index + len(stop) if self.include_stop_str_in_output else index

    def stream_text(self, finished: bool) -> str:
        """The output text that is safe to show: while the request runs, the last
        stop_buffer_length characters are held back (they may be the start of a stop
        string); once finished, everything."""
        if finished or not self.stop_buffer_length:
            return self._text
        return self._text[: max(len(self._text) - self.stop_buffer_length, 0)]

    def get_delta(self, finished: bool) -> str:
        """Text to stream since the last call (see stream_text), at a cost that does not grow
        with the text's length."""
        end = len(self._text)
        if not finished and self.stop_buffer_length:
            end = max(end - self.stop_buffer_length, 0)
        start = self._last_delta_offset
        if end <= start:
            return ""
        self._last_delta_offset = end
        return self._text[start:end]
