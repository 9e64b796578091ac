"""A real jaxserve HTTP server on loopback, over one tiny engine shared by the module.

`make_server(**server_args)` starts build_app on a TestServer (a real port, handler
cancellation on client disconnect, as in production) with a fresh AsyncLLMEngine thread
over the shared LLMEngine; the thread stops when the test ends.
"""

from __future__ import annotations

import openai
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from server_inputs import MAX_TOKENS, MODEL, PROMPTS, start_server
from tiny_models import engine_kwargs

from jaxserve.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


@pytest.fixture(scope="session")
def llm_engine(tiny_llama_gqa) -> LLMEngine:
    args = EngineArgs(model=tiny_llama_gqa[0], served_model_name=[MODEL, "tiny-alias"], **engine_kwargs())
    return LLMEngine.from_engine_args(args)


@pytest.fixture(scope="session")
def reference(llm_engine) -> dict[str, tuple[str, list[int]]]:
    """Greedy (text, token ids) of every prompt in PROMPTS, from the engine driven offline
    before any server thread owns it, with the other scheduling than the server's (which is
    the engine's own): every served-against-offline comparison checks the two agree."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        llm_engine.add_request(f"ref-{i}", prompt, params)
    done = {}
    serving = llm_engine.async_scheduling
    llm_engine.async_scheduling = not serving
    try:
        while llm_engine.has_unfinished_requests():
            for out in llm_engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        llm_engine.async_scheduling = serving
    return {
        p: (done[f"ref-{i}"].outputs[0].text, done[f"ref-{i}"].outputs[0].token_ids)
        for i, p in enumerate(PROMPTS)
    }


@pytest.fixture
async def make_server(llm_engine, reference):
    servers = []

    async def start(max_body_bytes: int | None = None, ssl=None, **server_args) -> TestServer:
        servers.append(await start_server(llm_engine, max_body_bytes, ssl, **server_args))
        return servers[-1]

    yield start
    for server in servers:
        await server.close()
    assert not llm_engine.has_unfinished_requests(), "a test left requests in the engine"


@pytest.fixture
async def server(make_server) -> TestServer:
    return await make_server()


@pytest.fixture
async def http(server):
    """(session, base url) of the default server."""
    async with ClientSession() as session:
        yield session, str(server.make_url("/"))


@pytest.fixture
async def sdk(make_server):
    """An OpenAI SDK client of a server made with `make_server(**server_args)` (closed at the end)."""
    clients = []

    async def connect(**server_args) -> openai.AsyncOpenAI:
        server = await make_server(**server_args)
        clients.append(
            openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
        )
        return clients[-1]

    yield connect
    for c in clients:
        await c.close()
