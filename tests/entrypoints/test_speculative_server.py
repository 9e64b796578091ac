"""The server over an engine with speculative decoding (n-gram or draft-model proposals):
completions and chat, whole and streamed, give the tokens the engine gives without proposals,
and a streamed chunk carries every token a step kept (several at once where proposals were kept)."""

from __future__ import annotations

import json

import openai
import pytest
from aiohttp import ClientSession
from server_inputs import MAX_TOKENS, MODEL, PROMPTS, start_server
from tiny_models import engine_kwargs

from jaxserve.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec_engine(request, tiny_llama_gqa) -> LLMEngine:
    """n-gram proposals, or a draft model's (the model itself)."""
    spec = NGRAM if request.param == "ngram" else {"model": tiny_llama_gqa[0], "num_speculative_tokens": 3}
    args = EngineArgs(
        model=tiny_llama_gqa[0], served_model_name=[MODEL], speculative_config=spec, **engine_kwargs()
    )
    return LLMEngine.from_engine_args(args)


@pytest.fixture
async def base_url(spec_engine):
    server = await start_server(spec_engine)
    yield str(server.make_url("/v1"))
    await server.close()


async def test_completions_whole_and_streamed_equal_the_plain_engine(base_url, reference, spec_engine):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    before = spec_engine.scheduler.spec_stats.snapshot()
    multi_token_chunks = 0
    for prompt in PROMPTS[:8]:
        text, token_ids = reference[prompt]
        whole = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1
        )
        assert whole.choices[0].text == text
        assert len(whole.choices[0].logprobs.tokens) == len(token_ids)
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1, stream=True
        )
        pieces = []
        async for chunk in stream:
            for choice in chunk.choices:
                pieces.append(choice.text)
                multi_token_chunks += len(choice.logprobs.tokens) > 1
        assert "".join(pieces) == text
    kept = spec_engine.scheduler.spec_stats.since(before).num_accepted_tokens
    assert kept > 0 and multi_token_chunks > 0
    await client.close()


async def test_chat_stream_equals_the_whole_reply(base_url):
    messages = [{"role": "user", "content": PROMPTS[3] + " " + PROMPTS[3]}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 32, "temperature": 0}
    async with ClientSession() as session:
        async with session.post(base_url + "/chat/completions", json=body) as r:
            assert r.status == 200
            whole = (await r.json())["choices"][0]["message"]["content"]
        async with session.post(base_url + "/chat/completions", json={**body, "stream": True}) as r:
            raw = await r.text()
    frames = [json.loads(f[len("data: ") :]) for f in raw.split("\n\n") if f and f != "data: [DONE]"]
    streamed = "".join(c["delta"].get("content") or "" for f in frames for c in f["choices"])
    assert streamed == whole
