"""What the completion and chat handlers share: model names, chat templates, prompt
lengths, request logging, running several prompts at once, logprobs in OpenAI's shapes,
and SSE framing.

Where it sits: between protocol.py (validated bodies) and the AsyncLLMEngine. Every
client mistake found here is a ValueError (the app turns it into a 400) or a
ModelNotFound (404); nothing here touches the engine's queues directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import web

from jaxserve.beam_search import BeamSearch, BeamSearchParams
from jaxserve.engine.async_engine import AsyncLLMEngine, EngineRequestError
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    TokenizeChatRequest,
    _SamplingRequest,
    error_body,
    random_id,
)
from jaxserve.entrypoints.openai.server_args import ServerArgs
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve.entrypoints.openai")

Prompt = dict  # {"prompt": text | None, "prompt_token_ids": [...]} as the engine takes it

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


class ModelNotFound(LookupError):
    pass


def load_chat_template(value: str | None) -> str | None:
    """--chat-template / the chat_template field: a file path, or the Jinja text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat template {value!r} is neither a readable file nor a Jinja template.")


# A template that loops over a message's content expects OpenAI's list of parts.
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")


def detect_content_format(template: str | None) -> str:
    return "openai" if template and _LOOPS_OVER_CONTENT.search(template) else "string"


def _text_parts(content: list[dict[str, Any]]) -> list[str]:
    texts = []
    for part in content:
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"message content parts of type {kind!r} are not supported; only 'text'.")
        texts.append(part["text"])
    return texts


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, args: ServerArgs):
        self.engine = engine
        self.args = args
        llm = engine.engine
        self.tokenizer = llm.tokenizer
        self.model_config = llm.config.model_config
        self.max_model_len = self.model_config.max_model_len
        self.served_model_names = list(self.model_config.served_model_name)
        self.sampling_defaults = dict(llm.sampling_defaults)
        self.chat_template = load_chat_template(args.chat_template)
        if self.chat_template is None and self.tokenizer is not None:
            self.chat_template = getattr(self.tokenizer, "chat_template", None)

    # ---- checks --------------------------------------------------------------------------

    def model_name(self, requested: str | None) -> str:
        if requested is None or requested in self.served_model_names:
            return requested or self.served_model_names[0]
        raise ModelNotFound(f"The model `{requested}` does not exist.")

    def require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("This server was started with --skip-tokenizer-init: send token ids, not text.")
        return self.tokenizer

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """The request's max_tokens, checked against the context length like vLLM does."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input messages."
            )
        if requested is None:
            room = limit - prompt_len
            default = self.sampling_defaults.get("max_tokens")
            return room if default is None else min(room, default)
        if prompt_len + requested > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        return requested

    # ---- prompts -------------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool, truncate: int | None = None) -> Prompt:
        ids = self.require_tokenizer().encode(text, add_special_tokens=add_special_tokens)
        return {"prompt": text, "prompt_token_ids": ids[-truncate:] if truncate else ids}

    def token_prompt(self, ids: Sequence[int], truncate: int | None = None) -> Prompt:
        self.engine.engine.check_prompt_token_ids(ids)  # before the tokenizer sees them
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
        ids = list(ids)
        return {"prompt": text, "prompt_token_ids": ids[-truncate:] if truncate else ids}

    def render_chat(self, body: ChatCompletionRequest | TokenizeChatRequest) -> str:
        """The conversation as the prompt text the model's chat template makes of it."""
        tokenizer = self.require_tokenizer()
        template = load_chat_template(body.chat_template) or self.chat_template
        if template is None:
            raise ValueError(
                "The model has no chat template and none was given (--chat-template or chat_template)."
            )
        content_format = self.args.chat_template_content_format
        if content_format == "auto":
            content_format = detect_content_format(template)
        conversation = []
        for m in body.messages:
            message = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                texts = _text_parts(m.content)
                if content_format == "string":
                    message["content"] = "\n".join(texts)
                else:
                    message["content"] = [{"type": "text", "text": t} for t in texts]
            elif isinstance(m.content, str) and content_format == "openai":
                message["content"] = [{"type": "text", "text": m.content}]
            conversation.append(message)
        kwargs = dict(body.chat_template_kwargs or {})
        if getattr(body, "tools", None):
            kwargs["tools"] = body.tools
        try:
            return tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except Exception as e:  # a template error is about the request's messages
            raise ValueError(f"The chat template failed on these messages: {e}") from None

    # ---- running -------------------------------------------------------------------------

    def request_id(self, raw: web.Request, body: _SamplingRequest, prefix: str) -> str:
        base = raw.headers.get("X-Request-Id") or body.request_id
        return f"{prefix}-{base}" if base else random_id(prefix)

    def log_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        if self.args.disable_log_requests:
            return
        limit = self.args.max_log_len
        text, ids = prompt["prompt"], prompt["prompt_token_ids"]
        if limit is not None:
            text = text[:limit] if text is not None else None
            ids = ids[:limit]
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id, text, params, ids
        )

    def generate_all(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: list[SamplingParams],
        priority: int,
        beams: list[BeamSearchParams | None] | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several prompts as they come, tagged with the prompt's index.

        Every prompt is checked (make_request) before any is queued, so a bad second
        prompt never leaves the first one running. Leaving early aborts them all. With
        `beams` (use_beam_search), each prompt's beam search yields one final output.
        """
        if beams is not None and beams[0] is not None:
            searches = [self.engine.start_beam_search(p, b) for p, b in zip(prompts, beams, strict=True)]
            return _merge(
                [
                    self._beam_output(request_id if len(prompts) == 1 else f"{request_id}-{i}", p, s, sp)
                    for i, (p, s, sp) in enumerate(zip(prompts, searches, params, strict=True))
                ]
            )
        parents = [
            self.engine.make_request(
                p, sp, request_id if len(prompts) == 1 else f"{request_id}-{i}", priority
            )
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        return _merge([self.engine.stream(parent) for parent in parents])

    async def _beam_output(
        self, request_id: str, prompt: Prompt, search: BeamSearch, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """A beam search's result as one finished RequestOutput: the beams as completions,
        best first, with the logprobs the request asked for (the chosen token and its top k)."""
        result = await self.engine.beam_search(search, request_id)
        prompt_len = len(prompt["prompt_token_ids"])
        tokenizer = self.engine.engine.tokenizer
        k = params.logprobs
        completions = []
        for index, seq in enumerate(result.sequences):
            generated = seq.tokens[prompt_len:]
            text = (
                tokenizer.decode(generated, skip_special_tokens=params.skip_special_tokens)
                if tokenizer
                else ""
            )
            logprobs = None
            if k is not None:
                logprobs = [
                    {t: lp for t, lp in entry.items() if t == token or (k == -1 or lp.rank <= k)}
                    for entry, token in zip(seq.logprobs, generated)
                ]
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=generated,
                    cumulative_logprob=seq.cum_logprob,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        yield RequestOutput(
            request_id, prompt["prompt"], prompt["prompt_token_ids"], completions, finished=True
        )

    # ---- logprobs ------------------------------------------------------------------------

    def as_token_ids(self, body: _SamplingRequest) -> bool:
        """Whether tokens are written `token_id:N` (the request's field, else the server flag)."""
        flag = body.return_tokens_as_token_ids
        return self.args.return_tokens_as_token_ids if flag is None else flag

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

    @staticmethod
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

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": None,
        }
        if self.args.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Items of several streams as they come, tagged with the stream's index; closing the
    merged stream closes (and so aborts) every one of them."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(gen) as g:
                async for out in g:
                    queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the reader below
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse_response(raw: web.Request, chunks: AsyncIterator[dict]) -> web.StreamResponse:
    """Stream `chunks` as server-sent events, then `data: [DONE]`. An engine failure after
    the stream has started is sent as an error event (the status line is already out)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(raw)
    async with contextlib.aclosing(chunks) as gen:
        try:
            async for chunk in gen:
                await _send(response, chunk)
        except EngineRequestError as e:
            await _send(response, error_body(str(e), 500))
    await _send(response, "[DONE]")
    await response.write_eof()
    return response


async def _send(response: web.StreamResponse, data: dict | str) -> None:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    await response.write(f"data: {payload}\n\n".encode())
