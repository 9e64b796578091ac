"""POST /v1/completions: one or several prompts (text or token ids), JSON or SSE.

Choice i * n + j is completion j of prompt i, as in OpenAI's API. With `echo` the prompt
text comes first (in the first chunk when streaming), and with `logprobs` too the prompt's
tokens lead the logprobs (the first one with null values), as in vLLM. `prompt_logprobs`
(vLLM's field) comes back on each choice of a plain response.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from jaxserve.engine.tracing import trace_headers
from jaxserve.entrypoints.openai.logprobs import prompt_logprobs
from jaxserve.entrypoints.openai.protocol import CompletionRequest, now
from jaxserve.entrypoints.openai.serving_engine import OpenAIServing, Prompt
from jaxserve.entrypoints.openai.sse import sse_response
from jaxserve.entrypoints.openai.structured_outputs import structured_outputs_field, structured_outputs_params
from jaxserve.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, body: CompletionRequest, raw: web.Request) -> web.StreamResponse:
        model = self.model_name(body.model)
        body.check_stream_options()
        body.check_logprobs()
        if body.suffix is not None:
            raise ValueError("suffix is not supported.")
        prompts: list[Prompt] = [
            self.embeds_prompt(e, body.truncate_prompt_tokens) for e in body.embeds_list()
        ]
        for p in body.prompts():
            if isinstance(p, str):
                prompts.append(self.tokenize(p, body.add_special_tokens, body.truncate_prompt_tokens))
            else:
                prompts.append(self.token_prompt(p, body.truncate_prompt_tokens))
        constraint = structured_outputs_params(body)
        await self.check_structured_outputs(constraint, structured_outputs_field(body))
        params = [
            body.to_sampling_params(
                self.max_tokens(body.max_tokens, len(p["prompt_token_ids"])),
                self.sampling_defaults,
                constraint,
            )
            for p in prompts
        ]
        beams = [body.to_beam_search_params(sp.max_tokens, constraint) for sp in params]
        request_id = self.request_id(raw, body, "cmpl")
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            self.log_request(request_id if len(prompts) == 1 else f"{request_id}-{i}", p, sp)
        outputs = self.generate_all(
            request_id, prompts, params, body.priority, beams, model, trace_headers(raw.headers)
        )
        head = {"id": request_id, "object": "text_completion", "created": now(), "model": model}
        if body.stream:
            return await sse_response(raw, self._chunks(body, head, prompts, outputs))
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async with contextlib.aclosing(outputs) as gen:
            async for i, out in gen:
                finals[i] = out
        as_ids = self.as_token_ids(body)
        choices, completion_tokens, cached = [], 0, 0
        for i, out in enumerate(finals):
            cached += out.num_cached_tokens
            out_prompt_logprobs = prompt_logprobs(out)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text = (prompts[i]["prompt"] or "") + c.text if body.echo else c.text
                logprobs = None
                if body.logprobs is not None:
                    ids, entries = self._logprob_tokens(out, c, echo=body.echo)
                    logprobs, _ = self.logprob_formatter.completion_logprobs(ids, entries, as_ids)
                choice = _choice(i * body.n + c.index, text, logprobs, c.finish_reason, c.stop_reason)
                choice["prompt_logprobs"] = out_prompt_logprobs
                choices.append(choice)
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        return web.json_response(
            {**head, "choices": choices, "usage": self.usage(prompt_tokens, completion_tokens, cached)}
        )

    @staticmethod
    def _logprob_tokens(out: RequestOutput, c: CompletionOutput, echo: bool) -> tuple[list, list]:
        """The output's tokens with their logprob entries, the prompt's first when `echo`; None
        for a token without one (the first prompt token)."""

        def padded(entries: list, n: int) -> list:
            return entries[:n] + [None] * (n - len(entries))

        ids = list(c.token_ids)
        entries = padded(list(c.logprobs or []), len(ids))
        if echo:
            prompt_ids = list(out.prompt_token_ids)
            ids, entries = (
                prompt_ids + ids,
                padded(list(out.prompt_logprobs or []), len(prompt_ids)) + entries,
            )
        return ids, entries

    async def _chunks(self, body, head, prompts, outputs) -> AsyncIterator[dict]:
        """Chunks from the engine's outputs, each the text and tokens new since the last (DELTA)."""
        tokens: dict[int, int] = {}  # choice index -> tokens generated
        offsets: dict[int, int] = {}  # choice index -> text_offset of the next token
        done: set[int] = set()  # choice indexes whose last chunk was sent
        wants_logprobs = body.logprobs is not None
        as_ids = self.as_token_ids(body)
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        cached = 0
        async with contextlib.aclosing(outputs) as gen:
            async for i, out in gen:
                for c in out.outputs:
                    index = i * body.n + c.index
                    if index in done:  # a finished sample still shows in its siblings' outputs
                        continue
                    if c.finish_reason is not None:
                        done.add(index)
                    first = index not in tokens
                    delta = c.text
                    if first and body.echo:
                        delta = (prompts[i]["prompt"] or "") + delta
                    tokens[index] = tokens.get(index, 0) + len(c.token_ids)
                    logprobs = None
                    if wants_logprobs:
                        ids, entries = self._logprob_tokens(out, c, echo=first and body.echo)
                        if ids:
                            logprobs, offsets[index] = self.logprob_formatter.completion_logprobs(
                                ids, entries, as_ids, offsets.get(index, 0)
                            )
                    if not delta and logprobs is None and c.finish_reason is None:
                        continue
                    if wants_logprobs and logprobs is None:
                        logprobs = self.logprob_formatter.completion_logprobs(
                            [], [], as_ids, offsets.get(index, 0)
                        )[0]
                    chunk = {
                        **head,
                        "choices": [_choice(index, delta, logprobs, c.finish_reason, c.stop_reason)],
                    }
                    if body.continuous_usage:
                        chunk["usage"] = self.usage(prompt_tokens, sum(tokens.values()), cached)
                    yield chunk
                if out.finished:
                    cached += out.num_cached_tokens
        if body.include_usage:
            usage = self.usage(prompt_tokens, sum(tokens.values()), cached)
            yield {**head, "choices": [], "usage": usage}


def _choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
