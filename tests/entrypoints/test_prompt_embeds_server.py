"""/v1/completions with `prompt_embeds` (vLLM's field: base64 torch.save tensors, one or a list,
beside or instead of `prompt`): through the OpenAI SDK's extra_body, whole and streamed, the
embeddings of a prompt's tokens give the prompt's own completion; the embeddings' choices come
first; bad tensors, echo, beam search and a server without --enable-prompt-embeds are 400s."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch
from aiohttp import ClientSession
from server_inputs import MAX_TOKENS, MODEL, PROMPTS, start_server
from tiny_models import engine_kwargs

from jaxserve.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine


def b64(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def embeds_engine(tiny_llama_gqa) -> LLMEngine:
    args = EngineArgs(
        model=tiny_llama_gqa[0], served_model_name=[MODEL], enable_prompt_embeds=True, **engine_kwargs()
    )
    return LLMEngine.from_engine_args(args)


@pytest.fixture
async def base_url(embeds_engine):
    server = await start_server(embeds_engine)
    yield str(server.make_url("/v1"))
    await server.close()


def embeddings_of(prompt: str, embeds_engine, model, dtype=torch.float32) -> torch.Tensor:
    ids = embeds_engine.tokenizer.encode(prompt)
    return model.get_input_embeddings().weight.detach()[ids].to(dtype)


async def test_embeddings_complete_as_their_prompt_whole_and_streamed(
    base_url, embeds_engine, tiny_llama_gqa, reference
):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    model = tiny_llama_gqa[1]
    for prompt in PROMPTS[:3]:
        text, token_ids = reference[prompt]
        embeds = embeddings_of(prompt, embeds_engine, model)
        whole = await client.completions.create(
            model=MODEL,
            prompt="",
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"prompt_embeds": b64(embeds)},
        )
        assert whole.choices[0].text == text
        assert whole.usage.prompt_tokens == len(embeds) and whole.usage.completion_tokens == len(token_ids)
        stream = await client.completions.create(
            model=MODEL, prompt="", max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"prompt_embeds": b64(embeds)},
        )  # fmt: skip
        assert "".join([c.choices[0].text async for c in stream if c.choices]) == text
    # a batch [1, L, H] tensor (vLLM squeezes it), and a list beside text prompts: embeddings first
    first, second = PROMPTS[3], PROMPTS[4]
    both = await client.completions.create(
        model=MODEL, prompt=[second], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"prompt_embeds": [b64(embeddings_of(first, embeds_engine, model)[None])]},
    )  # fmt: skip
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [
        reference[first][0],
        reference[second][0],
    ]


async def test_half_precision_tensors_are_read(base_url, embeds_engine, tiny_llama_gqa):
    """float16 / bfloat16 tensors decode to their values: each completes as its float32 upcast."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    embeds = embeddings_of(PROMPTS[0], embeds_engine, tiny_llama_gqa[1])
    for dtype in (torch.float16, torch.bfloat16):
        low = embeds.to(dtype)
        texts = []
        for t in (low, low.float()):
            out = await client.completions.create(
                model=MODEL,
                prompt="",
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"prompt_embeds": b64(t)},
            )
            texts.append(out.choices[0].text)
        assert texts[0] == texts[1]


def _sparse() -> str:
    return b64(torch.eye(64)[:3].to_sparse())


@pytest.mark.parametrize(
    "body,message",
    [
        ({"prompt_embeds": "not base64!"}, "base64"),
        ({"prompt_embeds": base64.b64encode(b"PK\x03\x04 not a zip").decode()}, "torch.save"),
        ({"prompt_embeds": "SPARSE"}, "torch.save"),
        ({"prompt_embeds": "INT"}, "torch.save"),
        ({"prompt_embeds": "WIDTH"}, "hidden size"),
        ({"prompt_embeds": "OK", "echo": True}, "echo"),
        ({"prompt_embeds": "OK", "use_beam_search": True, "n": 2}, "beam"),
        ({"prompt_embeds": []}, "prompt_embeds"),
        ({}, "prompt"),
    ],
)
async def test_bad_prompt_embeds_are_400s(base_url, body, message):
    tensors = {
        "SPARSE": _sparse(),
        "INT": b64(torch.arange(64).reshape(1, 64)),
        "WIDTH": b64(torch.zeros(3, 7)),
        "OK": b64(torch.zeros(3, 64)),
    }
    if isinstance(body.get("prompt_embeds"), str):
        body = {**body, "prompt_embeds": tensors.get(body["prompt_embeds"], body["prompt_embeds"])}
    async with ClientSession() as session:
        async with session.post(
            f"{base_url}/completions", json={"model": MODEL, "max_tokens": 4, **body}
        ) as r:
            assert r.status == 400, await r.text()
            error = (await r.json())["error"]
            assert message in error["message"] and error["type"] == "BadRequestError"
        async with session.post(
            f"{base_url}/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
        ) as r:
            assert r.status == 200  # the engine serves on


async def test_a_server_without_the_flag_refuses_prompt_embeds(http):
    session, url = http
    body = {"model": MODEL, "prompt_embeds": b64(torch.zeros(3, 64)), "max_tokens": 4}
    async with session.post(f"{url}v1/completions", json=body) as r:
        assert r.status == 400
        assert "--enable-prompt-embeds" in (await r.json())["error"]["message"]
