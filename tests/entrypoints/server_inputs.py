"""What the server tests send: the served model's name, a token budget and 32 prompts. A module of
its own so that tests import it by a name no other directory's module shares (`from conftest
import` finds whichever conftest.py was imported last); and how a test serves an engine."""

from __future__ import annotations

from aiohttp.test_utils import TestServer

from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints.openai.api_server import HANDLER_SETTINGS, build_app
from jaxserve.entrypoints.openai.server_args import ServerArgs

MODEL = "tiny"
MAX_TOKENS = 12
_WORDS = "The quick brown fox jumps over the lazy dog Paris is capital of France JAX compiles".split()
# 32 distinct prompts of different lengths.
PROMPTS = [" ".join(_WORDS[i % 7 : i % 7 + 2 + i % 9]) + f" {i}" for i in range(32)]


async def start_server(
    llm_engine: LLMEngine, max_body_bytes: int | None = None, ssl=None, **server_args
) -> TestServer:
    """build_app on a TestServer over a fresh AsyncLLMEngine thread of `llm_engine` (close it)."""
    engine = AsyncLLMEngine(llm_engine)
    kwargs = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
    app = build_app(engine, ServerArgs(**{"disable_log_stats": True, **server_args}), **kwargs)
    server = TestServer(app, host="127.0.0.1", **HANDLER_SETTINGS)
    await server.start_server(ssl=ssl)
    server.engine = engine
    return server
