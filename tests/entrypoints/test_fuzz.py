"""The server's own OpenAPI document, fuzzed: no generated request gets a 5xx or a response the
document does not describe.

schemathesis generates, for every operation, bodies that fit the request schemas and bodies that
break them (wrong types, missing fields, out-of-range values, odd strings); each is sent to a real
server on loopback over the tiny engine, with generation capped short. The hand-written cases in
test_server_errors.py are the corpus of what fuzzing found before; grow it with every new find.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import pytest
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from tiny_models import engine_kwargs, make_family_checkpoint, make_idefics3_checkpoint

from jaxserve.args import EngineArgs
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.openapi import openapi_document
from jaxserve.entrypoints.openai.server_args import ServerArgs

pytestmark = pytest.mark.fuzz

schema = schemathesis.openapi.from_dict(openapi_document())
schema.config.generation.update(modes=list(GenerationMode), max_examples=25)
pooling_schema = schemathesis.openapi.from_dict(openapi_document()).include(
    path_regex="^/(v1/embeddings|pooling|v2/embed|classify|v1/score|score|rerank|v1/rerank|v2/rerank)$"
)
pooling_schema.config.generation.update(modes=list(GenerationMode), max_examples=25)
# chat with content parts (text and image_url) against a model that takes images
vlm_schema = schemathesis.openapi.from_dict(openapi_document()).include(path_regex="^/v1/chat/completions$")
vlm_schema.config.generation.update(modes=list(GenerationMode), max_examples=40)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@contextlib.contextmanager
def serving(llm_engine):
    """A real server in a thread of its own (schemathesis calls it synchronously): its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    engine = AsyncLLMEngine(llm_engine)
    runner = web.AppRunner(build_app(engine, ServerArgs(disable_log_stats=True, disable_log_requests=True)))
    ready = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(60)
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(60)
    assert not llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def base_url(llm_engine):
    with serving(llm_engine) as url:
        yield url


@pytest.fixture(scope="module")
def pooling_url(tmp_path_factory):
    """A server over a pooling model (a tiny Qwen3 served for embeddings)."""
    path = tmp_path_factory.mktemp("fuzz_embedder")
    make_family_checkpoint(path, "qwen3")
    args = EngineArgs(model=str(path), runner="pooling", **engine_kwargs(max_model_len=64))
    with serving(LLMEngine.from_engine_args(args)) as url:
        yield url


@pytest.fixture(scope="module")
def vlm_url(tmp_path_factory):
    """A server over a vision-language model (a tiny Idefics3), file:// URLs allowed under an
    empty directory."""
    path = tmp_path_factory.mktemp("fuzz_vlm")
    make_idefics3_checkpoint(path)
    media = tmp_path_factory.mktemp("fuzz_media")
    args = EngineArgs(model=str(path), allowed_local_media_path=str(media), **engine_kwargs())
    with serving(LLMEngine.from_engine_args(args)) as url:
        yield url


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_request_gets_a_5xx_or_an_undocumented_answer(case, base_url):
    if isinstance(case.body, dict):  # generation capped short: the point is the parsing, not the model
        key = "max_completion_tokens" if "messages" in case.body else "max_tokens"
        if case.body.get(key) is None or (isinstance(case.body[key], int) and case.body[key] > 4):
            case.body[key] = 4
    case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=30)


@pooling_schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_pooling_request_gets_a_5xx_or_an_undocumented_answer(case, pooling_url):
    """The pooling endpoints against a model that serves them (the generation server refuses every
    embedding it is asked for, so only here do the generated inputs reach the engine)."""
    case.call_and_validate(base_url=pooling_url, checks=CHECKS, timeout=30)


@vlm_schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_chat_with_content_parts_gets_a_5xx_or_an_undocumented_answer(case, vlm_url):
    """Chat requests whose messages hold generated text and image_url parts (URLs of every
    scheme, data that is no image) against a model that takes images."""
    if isinstance(case.body, dict):
        tokens = case.body.get("max_completion_tokens")
        if tokens is None or (isinstance(tokens, int) and tokens > 4):
            case.body["max_completion_tokens"] = 4
    case.call_and_validate(base_url=vlm_url, checks=CHECKS, timeout=30)
