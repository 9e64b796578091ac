"""POST /v1/embeddings and POST /pooling: each input's pooled vector from a pooling model; POST
/score and /rerank (also /v1/rerank, /v2/rerank): similarities of texts' embeddings.

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
from jaxserve.entrypoints.openai.score_protocol import RerankRequest, ScoreRequest
from jaxserve.entrypoints.openai.serving_engine import OpenAIServing, Prompt
from jaxserve.outputs import PoolingRequestOutput
from jaxserve.pooling_params import PoolingParams, cosine

# endpoint kind -> (request id prefix, each item's "object", the field holding its vector, task)
KINDS = {
    "embedding": ("embd", "embedding", "embedding", "embed"),
    "pooling": ("pool", "pooling", "data", "encode"),
}


class OpenAIServingPooling(OpenAIServing):
    async def create(self, body: EmbeddingRequest, raw: web.Request, kind: str) -> web.Response:
        prefix, item, field, task = KINDS[kind]
        model = self.model_name(body.model)
        request_id = self.request_id(raw, body, prefix)
        finals = await self._pool(
            request_id, self._prompts(body), body.to_pooling_params(task), body, model, raw
        )
        data = [
            {"index": i, "object": item, field: encoded(out.outputs.data, body.encoding_format)}
            for i, out in enumerate(finals)
        ]
        return web.json_response(self._answer(request_id, model, {"data": data}, finals))

    async def score(self, body: ScoreRequest, raw: web.Request) -> web.Response:
        """vLLM's /score over an embedding model: the cosine similarity of each pair's embeddings."""
        model = self.model_name(body.model)
        pairs = body.pairs()
        request_id = self.request_id(raw, body, "score")
        vectors, finals = await self._embed_texts(
            request_id, [t for pair in pairs for t in pair], body, model, raw
        )
        data = [
            {"index": i, "object": "score", "score": cosine(vectors[a], vectors[b])}
            for i, (a, b) in enumerate(pairs)
        ]
        return web.json_response(self._answer(request_id, model, {"data": data}, finals))

    async def rerank(self, body: RerankRequest, raw: web.Request) -> web.Response:
        """Jina's and Cohere's rerank over an embedding model: documents by the cosine similarity of
        their embedding to the query's, best first (the top_n of them; 0: all)."""
        model = self.model_name(body.model)
        request_id = self.request_id(raw, body, "rerank")
        vectors, finals = await self._embed_texts(request_id, [body.query, *body.documents], body, model, raw)
        scored = sorted(
            ((cosine(vectors[body.query], vectors[d]), i) for i, d in enumerate(body.documents)),
            key=lambda x: -x[0],
        )
        results = [
            {
                "index": i,
                "relevance_score": score,
                **({"document": {"text": body.documents[i]}} if body.return_documents else {}),
            }
            for score, i in scored[: body.top_n or None]
        ]
        answer = self._answer(request_id, model, {"results": results}, finals)
        answer["usage"] = {"total_tokens": answer["usage"]["total_tokens"]}
        return web.json_response(answer)

    async def _embed_texts(self, request_id: str, texts: list[str], body, model: str, raw: web.Request):
        """Each distinct text's embedding (text -> vector), and the outputs it came from."""
        distinct = list(dict.fromkeys(texts))
        params = PoolingParams(truncate_prompt_tokens=body.truncate_prompt_tokens, task="embed")
        finals = await self._pool(
            request_id, [self.tokenize(t, True) for t in distinct], params, body, model, raw
        )
        return {t: out.outputs.data for t, out in zip(distinct, finals)}, finals

    async def _pool(self, request_id: str, prompts: list[Prompt], params: PoolingParams, body, model, raw):
        """Every prompt's final output, in order (all checked before any is queued)."""
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
        return finals

    def _answer(self, request_id: str, model: str, fields: dict, finals: list[PoolingRequestOutput]) -> dict:
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        return {
            "id": request_id,
            "object": "list",
            "created": now(),
            "model": model,
            **fields,
            "usage": self.usage(prompt_tokens, 0, 0),
        }

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
