"""The server's OpenAPI document, served at /openapi.json.

Where it sits: beside the routes (api_server.py), read by clients and by the tests' fuzzer, which
generates requests from it and fails on any answer it does not describe. The request schemas come
from the pydantic models in protocol.py, so the document cannot drift from what is validated.
"""

from __future__ import annotations

from http import HTTPStatus

from pydantic import BaseModel

from jaxserve import __version__
from jaxserve.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    CohereEmbedRequest,
    EmbeddingRequest,
    PoolingRequest,
)
from jaxserve.entrypoints.openai.protocol import (
    ERROR_RESPONSE_SCHEMA,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeCompletionRequest,
)
from jaxserve.entrypoints.openai.responses_protocol import ResponsesRequest
from jaxserve.entrypoints.openai.score_protocol import RerankRequest, ScoreRequest


def _body(model: type[BaseModel], schemas: dict) -> dict:
    """A required JSON body of the pydantic model; its schema (and those it refers to) go into
    `schemas`."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _answers(*content_types: str, errors: tuple[str, ...] = ()) -> dict:
    """200 with these content types, and the OpenAI-style error body for `errors` (a client
    mistake is always a 4xx with it; a 5xx would be a server bug)."""
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    responses = {"200": {"description": "Successful Response"}}
    if content_types:
        responses["200"]["content"] = {t: {} for t in content_types}
    for status in errors:
        responses[status] = {"description": HTTPStatus(int(status)).phrase, **error}
    return {"responses": responses}


# Endpoints that take a JSON body and answer JSON: (path, summary, request body)
_JSON_POSTS = (
    ("/v1/embeddings", "Create embeddings", EmbeddingRequest),
    ("/pooling", "Pooling", PoolingRequest),
    ("/v2/embed", "Embed (Cohere)", CohereEmbedRequest),
    ("/classify", "Classify", ClassificationRequest),
    ("/score", "Score", ScoreRequest),
    ("/v1/score", "Score", ScoreRequest),
    ("/rerank", "Rerank", RerankRequest),
    ("/v1/rerank", "Rerank", RerankRequest),
    ("/v2/rerank", "Rerank", RerankRequest),
    ("/tokenize", "Tokenize", TokenizeCompletionRequest),
    ("/detokenize", "Detokenize", DetokenizeRequest),
)


def openapi_document(root_path: str | None = None) -> dict:
    """The OpenAPI description of the endpoints, request schemas from the pydantic models."""
    schemas: dict = {}

    def body(model: type[BaseModel]) -> dict:
        return _body(model, schemas)

    client_errors = ("400", "404", "413", "415")
    json_answer = _answers("application/json", errors=client_errors)
    generation = _answers("application/json", "text/event-stream", errors=client_errors)
    paths = {
        "/health": {"get": {"summary": "Health", **_answers(errors=("503",))}},
        "/ping": {
            "get": {"summary": "Ping", **_answers(errors=("503",))},
            "post": {"summary": "Ping", **_answers(errors=("503",))},
        },
        "/version": {"get": {"summary": "Version", **_answers("application/json")}},
        "/metrics": {"get": {"summary": "Prometheus metrics", **_answers("text/plain")}},
        "/v1/models": {"get": {"summary": "List models", **_answers("application/json")}},
        "/v1/completions": {
            "post": {"summary": "Create completion", **body(CompletionRequest), **generation}
        },
        "/v1/chat/completions": {
            "post": {"summary": "Create chat completion", **body(ChatCompletionRequest), **generation}
        },
        "/v1/responses": {"post": {"summary": "Create response", **body(ResponsesRequest), **generation}},
        "/v1/responses/{response_id}": {
            "get": {
                "summary": "Retrieve response",
                "parameters": [
                    {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                **_answers("application/json", errors=("404",)),
            }
        },
        **{
            path: {"post": {"summary": summary, **body(model), **json_answer}}
            for path, summary, model in _JSON_POSTS
        },
    }
    schemas["ErrorResponse"] = ERROR_RESPONSE_SCHEMA
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve OpenAI-compatible API", "version": __version__},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if root_path:
        doc["servers"] = [{"url": root_path}]
    return doc
