"""POST /v1/embeddings and POST /pooling (and Cohere's POST /v2/embed): each input's pooled vector
from a pooling model; POST
/classify: a classifier's probabilities; POST /score and /rerank (also /v1/rerank, /v2/rerank):
pairs of texts scored by a cross-encoder, or by the cosine similarity of their embeddings.

Where it sits: like serving_completion.py, between the validated body (pooling_protocol.py) and
the AsyncLLMEngine; every input is checked before any is queued (generate_all). A model served for
generation answers 400 naming what it serves (the engine's InputProcessor says so).
"""

from __future__ import annotations

import contextlib

import numpy as np
from aiohttp import web

from jaxserve.engine.tracing import trace_headers
from jaxserve.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    CohereEmbedRequest,
    EmbeddingRequest,
    encoded,
)
from jaxserve.entrypoints.openai.protocol import TokenizeChatRequest, now
from jaxserve.entrypoints.openai.score_protocol import RerankRequest, ScoreRequest
from jaxserve.entrypoints.openai.serving_engine import OpenAIServing, Prompt
from jaxserve.outputs import PoolingRequestOutput
from jaxserve.pooling_params import PoolingParams, cosine, is_cross_encoder, pair_prompt

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

    async def cohere_embed(self, body: CohereEmbedRequest, raw: web.Request) -> web.Response:
        """Cohere's /v2/embed: the texts' embeddings in each encoding asked for."""
        model = self.model_name(body.model)
        request_id = self.request_id(raw, body, "embd")
        prompts = [self.tokenize(t, True) for t in body.texts]
        if body.truncate == "END":  # keep each text's first tokens
            for p in prompts:
                p["prompt_token_ids"] = p["prompt_token_ids"][: self.max_model_len]
        finals = await self._pool(request_id, prompts, body.to_pooling_params(), body, model, raw)
        embeddings = {
            kind: [encoded(out.outputs.data, kind) for out in finals] for kind in body.embedding_types
        }
        tokens = sum(len(out.prompt_token_ids) for out in finals)
        return web.json_response(
            {
                "id": request_id,
                "embeddings": embeddings,
                "texts": body.texts,
                "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens}},
                "response_type": "embeddings_by_type",
            }
        )

    async def classify(self, body: ClassificationRequest, raw: web.Request) -> web.Response:
        """vLLM's /classify: each input's class probabilities and most likely label."""
        model = self.model_name(body.model)
        request_id = self.request_id(raw, body, "classify")
        finals = await self._pool(
            request_id, self._prompts(body), body.to_pooling_params("classify"), body, model, raw
        )
        labels = self.model_config.pooler_config.labels
        data = [
            {
                "index": i,
                "label": labels[int(np.argmax(out.outputs.data))],
                "probs": np.asarray(out.outputs.data).tolist(),
                "num_classes": len(out.outputs.data),
            }
            for i, out in enumerate(finals)
        ]
        return web.json_response(self._answer(request_id, model, {"data": data}, finals))

    async def score(self, body: ScoreRequest, raw: web.Request) -> web.Response:
        """vLLM's /score: each (text_1, text_2) pair's score."""
        model = self.model_name(body.model)
        request_id = self.request_id(raw, body, "score")
        scores, finals = await self._scores(request_id, body.pairs(), body, model, raw)
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
        return web.json_response(self._answer(request_id, model, {"data": data}, finals))

    async def rerank(self, body: RerankRequest, raw: web.Request) -> web.Response:
        """Jina's and Cohere's rerank: the documents by their score against the query, best first
        (the top_n of them; 0: all)."""
        model = self.model_name(body.model)
        request_id = self.request_id(raw, body, "rerank")
        pairs = [(body.query, d) for d in body.documents]
        scores, finals = await self._scores(request_id, pairs, body, model, raw)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
        results = [
            {
                "index": i,
                "relevance_score": scores[i],
                **({"document": {"text": body.documents[i]}} if body.return_documents else {}),
            }
            for i in ranked
        ]
        answer = self._answer(request_id, model, {"results": results}, finals)
        answer["usage"] = {"total_tokens": answer["usage"]["total_tokens"]}
        return web.json_response(answer)

    async def _scores(
        self, request_id: str, pairs: list[tuple[str, str]], body, model: str, raw: web.Request
    ):
        """Each pair's score, and the outputs it came from: a cross-encoder's probability for the
        pair read together, or the cosine similarity of the two texts' embeddings (each distinct
        text embedded once)."""
        truncate = body.truncate_prompt_tokens
        if is_cross_encoder(self.model_config.pooler_config):
            prompts = [pair_prompt(self.require_tokenizer(), a, b) for a, b in pairs]
            params = PoolingParams(truncate_prompt_tokens=truncate, task="score")
            finals = await self._pool(request_id, prompts, params, body, model, raw)
            return [float(out.outputs.data[0]) for out in finals], finals
        distinct = list(dict.fromkeys(t for pair in pairs for t in pair))
        params = PoolingParams(truncate_prompt_tokens=truncate, task="embed")
        finals = await self._pool(
            request_id, [self.tokenize(t, True) for t in distinct], params, body, model, raw
        )
        vectors = {t: out.outputs.data for t, out in zip(distinct, finals)}
        return [cosine(vectors[a], vectors[b]) for a, b in pairs], finals

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
