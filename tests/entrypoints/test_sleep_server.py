"""Sleep mode over HTTP, as vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1): POST /sleep,
POST /wake_up, GET /is_sleeping, POST /reset_prefix_cache. A request sent while the server sleeps
waits and then gets the text it gets from an awake server; a stream running across a sleep ends
with the tokens it would have had."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from tiny_models import engine_kwargs

from jaxserve.args import EngineArgs
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints.openai.api_server import HANDLER_SETTINGS, build_app
from jaxserve.entrypoints.openai.server_args import ServerArgs

BODY = {
    "model": "tiny",
    "prompt": [5, 17, 300, 42, 9],
    "max_tokens": 24,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def engine(tiny_llama_gqa):
    args = EngineArgs(
        model=tiny_llama_gqa[0], served_model_name=["tiny"], enable_sleep_mode=True, **engine_kwargs()
    )
    return LLMEngine.from_engine_args(args)


@contextlib.asynccontextmanager
async def _serving(engine, monkeypatch, dev_mode: bool = True):
    """(client session, base URL) of a server on `engine`, with or without VLLM_SERVER_DEV_MODE."""
    if dev_mode:
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    else:
        monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    app = build_app(AsyncLLMEngine(engine), ServerArgs(disable_log_stats=True))
    server = TestServer(app, host="127.0.0.1", **HANDLER_SETTINGS)
    await server.start_server()
    try:
        async with ClientSession() as http:
            yield http, str(server.make_url("/"))
    finally:
        await server.close()


async def _text(http, url) -> str:
    async with http.post(url + "v1/completions", json=BODY) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["text"]


async def _is_sleeping(http, url) -> bool:
    async with http.get(url + "is_sleeping") as r:
        assert r.status == 200
        return (await r.json())["is_sleeping"]


async def test_a_request_waits_for_the_server_to_wake(engine, monkeypatch):
    async with _serving(engine, monkeypatch) as (http, url):
        want = await _text(http, url)
        assert await _is_sleeping(http, url) is False
        async with http.post(url + "sleep?level=1") as r:
            assert r.status == 200
        assert await _is_sleeping(http, url) is True
        waiting = asyncio.ensure_future(_text(http, url))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # asleep: queued, not served
        async with http.post(url + "wake_up") as r:
            assert r.status == 200
        assert await asyncio.wait_for(waiting, 60) == want
        assert await _is_sleeping(http, url) is False


async def test_a_stream_across_a_sleep_ends_as_without_it(engine, monkeypatch):
    async with _serving(engine, monkeypatch) as (http, url):
        want = await _text(http, url)
        text, slept = "", False
        async with http.post(url + "v1/completions", json={**BODY, "stream": True}) as r:
            async for line in r.content:
                line = line.decode().strip()
                if not line.startswith("data: {"):
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                if text and not slept:  # a few tokens in: sleep at level 2 and wake
                    slept = True
                    async with http.post(url + "reset_prefix_cache") as s:
                        assert s.status == 409  # this stream's pages are in use
                    async with http.post(url + "sleep?level=2") as s:
                        assert s.status == 200
                    async with http.post(url + "wake_up?tags=weights") as s:
                        assert s.status == 200
                    assert await _is_sleeping(http, url) is True  # the KV cache is still out
                    async with http.post(url + "wake_up?tags=kv_cache") as s:
                        assert s.status == 200
        assert slept and text == want


async def test_bad_values_are_400_and_the_endpoints_need_dev_mode(engine, monkeypatch):
    async with _serving(engine, monkeypatch) as (http, url):
        for path in ("sleep?level=3", "sleep?level=deep", "wake_up?tags=everything"):
            async with http.post(url + path) as r:
                assert r.status == 400, path
                assert (await r.json())["error"]["type"] == "BadRequestError"
        assert await _is_sleeping(http, url) is False
        async with http.post(url + "reset_prefix_cache") as r:
            assert r.status == 200
        assert engine.scheduler.block_manager.reset_prefix_cache()  # (nothing cached now)
    async with _serving(engine, monkeypatch, dev_mode=False) as (http, url):
        for method, path in (("POST", "sleep"), ("POST", "wake_up"), ("GET", "is_sleeping")):
            async with http.request(method, url + path) as r:
                assert r.status == 404
