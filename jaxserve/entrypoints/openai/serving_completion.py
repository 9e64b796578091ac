"""POST /v1/completions: one or several prompts (text or token ids), JSON or SSE.

Choice i * n + j is completion j of prompt i, as in OpenAI's API. With `echo` the prompt
text comes first (in the first chunk when streaming).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from jaxserve.entrypoints.openai.protocol import CompletionRequest, now
from jaxserve.entrypoints.openai.serving_engine import OpenAIServing, Prompt, sse_response
from jaxserve.outputs import RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, body: CompletionRequest, raw: web.Request) -> web.StreamResponse:
        model = self.model_name(body.model)
        body.check_stream_options()
        if body.suffix is not None:
            raise ValueError("suffix is not supported.")
        prompts: list[Prompt] = []
        for p in body.prompts():
            if isinstance(p, str):
                prompts.append(self.tokenize(p, body.add_special_tokens, body.truncate_prompt_tokens))
            else:
                prompts.append(self.token_prompt(p, body.truncate_prompt_tokens))
        params = [
            body.to_sampling_params(
                self.max_tokens(body.max_tokens, len(p["prompt_token_ids"])), self.sampling_defaults
            )
            for p in prompts
        ]
        request_id = self.request_id(raw, body, "cmpl")
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            self.log_request(request_id if len(prompts) == 1 else f"{request_id}-{i}", p, sp)
        outputs = self.generate_all(request_id, prompts, params, body.priority)
        head = {"id": request_id, "object": "text_completion", "created": now(), "model": model}
        if body.stream:
            return await sse_response(raw, self._chunks(body, head, prompts, outputs))
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async with contextlib.aclosing(outputs) as gen:
            async for i, out in gen:
                finals[i] = out
        choices, completion_tokens, cached = [], 0, 0
        for i, out in enumerate(finals):
            cached += out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text = (prompts[i]["prompt"] or "") + c.text if body.echo else c.text
                choices.append(_choice(i * body.n + c.index, text, c.finish_reason, c.stop_reason))
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        return web.json_response(
            {**head, "choices": choices, "usage": self.usage(prompt_tokens, completion_tokens, cached)}
        )

    async def _chunks(self, body, head, prompts, outputs) -> AsyncIterator[dict]:
        sent: dict[int, int] = {}  # choice index -> characters sent
        tokens: dict[int, int] = {}  # choice index -> tokens generated
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        cached = 0
        async with contextlib.aclosing(outputs) as gen:
            async for i, out in gen:
                for c in out.outputs:
                    index = i * body.n + c.index
                    first = index not in sent
                    delta = c.text[sent.get(index, 0) :]
                    if first and body.echo:
                        delta = (prompts[i]["prompt"] or "") + delta
                    sent[index] = len(c.text)
                    tokens[index] = len(c.token_ids)
                    if not delta and c.finish_reason is None:
                        continue
                    chunk = {**head, "choices": [_choice(index, delta, c.finish_reason, c.stop_reason)]}
                    if body.continuous_usage:
                        chunk["usage"] = self.usage(prompt_tokens, sum(tokens.values()), cached)
                    yield chunk
                if out.finished:
                    cached += out.num_cached_tokens
        if body.include_usage:
            usage = self.usage(prompt_tokens, sum(tokens.values()), cached)
            yield {**head, "choices": [], "usage": usage}


def _choice(index: int, text: str, finish_reason: str | None, stop_reason) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
