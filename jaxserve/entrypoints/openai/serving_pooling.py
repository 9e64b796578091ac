"""POST /v1/embeddings and POST /pooling: each input's pooled vector from a pooling model.

Where it sits: like serving_completion.py, between the validated body (pooling_protocol.py) and
the AsyncLLMEngine; every input is checked before any is queued (generate_all). A model served for
generation answers 400 naming what it serves (the engine's InputProcessor says so).
"""

from __future__ import annotations

import contextlib

from aiohttp import web

from jaxserve.engine.tracing import trace_headers
from jaxserve.entrypoints.openai.pooling_protocol import EmbeddingRequest, encoded
from jaxserve.entrypoints.openai.protocol import TokenizeChatRequest, now
from jaxserve.entrypoints.openai.serving_engine import OpenAIServing, Prompt
from jaxserve.outputs import PoolingRequestOutput

# endpoint kind -> (request id prefix, each item's "object", the field holding its vector, task)
KINDS = {
    "embedding": ("embd", "embedding", "embedding", "embed"),
    "pooling": ("pool", "pooling", "data", "encode"),
}


class OpenAIServingPooling(OpenAIServing):
    async def create(self, body: EmbeddingRequest, raw: web.Request, kind: str) -> web.Response:
        prefix, item, field, task = KINDS[kind]
        model = self.model_name(body.model)
        prompts = self._prompts(body)
        params = body.to_pooling_params(task)
        request_id = self.request_id(raw, body, prefix)
        for i, p in enumerate(prompts):
            self.log_request(request_id if len(prompts) == 1 else f"{request_id}-{i}", p, params)
        outputs = self.generate_all(
            request_id,
            prompts,
            [params] * len(prompts),
            body.priority,
            None,
            model,
            trace_headers(raw.headers),
        )
        finals: list[PoolingRequestOutput | None] = [None] * len(prompts)
        async with contextlib.aclosing(outputs) as gen:
            async for i, out in gen:
                finals[i] = out
        data = [
            {"index": i, "object": item, field: encoded(out.outputs.data, body.encoding_format)}
            for i, out in enumerate(finals)
        ]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        return web.json_response(
            {
                "id": request_id,
                "object": "list",
                "created": now(),
                "model": model,
                "data": data,
                "usage": self.usage(prompt_tokens, 0, 0),
            }
        )

    def _prompts(self, body: EmbeddingRequest) -> list[Prompt]:
        """The inputs as the engine takes them (its pooling params truncate them), or the
        conversation through the chat template."""
        if body.messages is not None and body.input is None:
            chat = TokenizeChatRequest(
                messages=body.messages,
                tools=body.tools,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template=body.chat_template,
                chat_template_kwargs=body.chat_template_kwargs,
            )
            return [self.tokenize(self.render_chat(chat), add_special_tokens=False)]
        return [
            self.tokenize(p, body.add_special_tokens) if isinstance(p, str) else self.token_prompt(p)
            for p in body.prompts()
        ]
