"""The OpenAI endpoints over loopback: answers agree with the engine run offline, streams
agree with plain responses, usage adds up, and the shapes are OpenAI's."""

from __future__ import annotations

import asyncio
import json

import pytest
from server_inputs import MAX_TOKENS, MODEL, PROMPTS

GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}


async def post(http, path: str, body, **kwargs):
    session, url = http
    async with session.post(url + path, json=body, **kwargs) as r:
        return r.status, await r.json()


async def sse_events(http, path: str, body) -> list[dict]:
    """The JSON events of an SSE response; asserts it ends with [DONE]."""
    session, url = http
    async with session.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.text()
    frames = [f for f in raw.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: ") :]) for f in frames[:-1]]


def streamed_text(events: list[dict], key: str = "text") -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            piece = c[key] if key == "text" else c["delta"].get("content", "")
            texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts


async def test_completion_matches_the_engine_offline(http, reference):
    prompt = PROMPTS[3]
    status, body = await post(http, "v1/completions", {"model": MODEL, "prompt": prompt, **GREEDY})
    assert status == 200, body
    text, token_ids = reference[prompt]
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == text and choice["index"] == 0
    assert choice["finish_reason"] in ("stop", "length")
    status, tok = await post(http, "tokenize", {"prompt": prompt})
    usage = body["usage"]
    assert usage["prompt_tokens"] == tok["count"]
    assert usage["completion_tokens"] == len(token_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("n", [1, 2])
async def test_streamed_completion_equals_the_plain_one(http, n):
    body = {"model": MODEL, "prompt": [PROMPTS[0], PROMPTS[5]], "n": n, "seed": 7, **GREEDY}
    status, plain = await post(http, "v1/completions", body)
    assert status == 200, plain
    events = await sse_events(http, "v1/completions", {**body, "stream": True, "stream_options": {}})
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == plain["usage"]
    assert all(e["object"] == "text_completion" and e.get("usage") is None for e in chunks)
    texts = streamed_text(chunks)
    assert len(plain["choices"]) == 2 * n
    assert {c["index"]: c["text"] for c in plain["choices"]} == texts
    finished = [c for e in chunks for c in e["choices"] if c["finish_reason"] is not None]
    assert sorted(c["index"] for c in finished) == list(range(2 * n))


async def test_chat_completion_streams_the_same_text(http):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[7]}]
    body = {"model": MODEL, "messages": messages, "max_completion_tokens": MAX_TOKENS, "temperature": 0}
    status, plain = await post(http, "v1/chat/completions", body)
    assert status == 200, plain
    assert plain["object"] == "chat.completion" and plain["id"].startswith("chatcmpl-")
    message = plain["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    events = await sse_events(
        http, "v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert streamed_text(events[:-1], "delta")[0] == message["content"]
    assert events[-1]["usage"] == plain["usage"]
    # The prompt is the chat template's rendering of the messages.
    status, tok = await post(http, "tokenize", {"messages": messages})
    assert plain["usage"]["prompt_tokens"] == tok["count"]


async def test_32_concurrent_streams_are_all_correct(http, reference):
    async def one(prompt):
        events = await sse_events(
            http, "v1/completions", {"model": MODEL, "prompt": prompt, "stream": True, **GREEDY}
        )
        return streamed_text(events)[0]

    texts = await asyncio.gather(*(one(p) for p in PROMPTS))
    assert len(PROMPTS) == 32
    assert texts == [reference[p][0] for p in PROMPTS]


async def test_token_id_prompts_echo_and_stop_strings(http, reference):
    prompt = PROMPTS[2]
    text, _ = reference[prompt]
    status, tok = await post(http, "tokenize", {"prompt": prompt})
    status, body = await post(http, "v1/completions", {"prompt": tok["tokens"], "echo": True, **GREEDY})
    assert status == 200, body
    assert body["model"] == MODEL  # no model named: the first served name
    status, detok = await post(http, "detokenize", {"tokens": tok["tokens"]})
    assert body["choices"][0]["text"] == detok["prompt"] + text
    stop = text[3:5]
    if stop.strip():
        request = {"prompt": prompt, "stop": [stop], **GREEDY}
        status, stopped = await post(http, "v1/completions", request)
        choice = stopped["choices"][0]
        assert choice["text"] == text[: text.index(stop)]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
        events = await sse_events(http, "v1/completions", {**request, "stream": True})
        assert streamed_text(events)[0] == choice["text"]


async def test_models_version_health_and_aliases(http):
    session, url = http
    async with session.get(url + "v1/models") as r:
        models = await r.json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL, "tiny-alias"]
    assert all(m["object"] == "model" and m["max_model_len"] == 256 for m in models["data"])
    status, body = await post(http, "v1/completions", {"model": "tiny-alias", "prompt": "a", "max_tokens": 2})
    assert status == 200 and body["model"] == "tiny-alias"
    for path in ("health", "ping"):
        async with session.get(url + path) as r:
            assert r.status == 200
    async with session.post(url + "ping") as r:
        assert r.status == 200
    async with session.get(url + "version") as r:
        assert (await r.json())["version"]


async def test_metrics_move_after_a_request(http):
    session, url = http

    async def sample(name: str, labels: str = f'model_name="{MODEL}"') -> float:
        async with session.get(url + "metrics") as r:
            text = await r.text()
        for line in text.splitlines():
            if line.startswith(f"jaxserve:{name}{{") and all(part in line for part in labels.split(",")):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = {
        "gen": await sample("generation_tokens_total"),
        "prompt": await sample("prompt_tokens_total"),
        "ok": await sample("request_success_total", f'finished_reason="length",model_name="{MODEL}"'),
        "ttft": await sample("time_to_first_token_seconds_count"),
        "e2e": await sample("e2e_request_latency_seconds_count"),
        "queue": await sample("request_queue_time_seconds_count"),
        "queries": await sample("prefix_cache_queries_total"),
    }
    body = {"model": MODEL, "prompt": PROMPTS[9], "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    status, out = await post(http, "v1/completions", body)
    assert status == 200
    assert await sample("generation_tokens_total") == before["gen"] + 5
    assert await sample("prompt_tokens_total") == before["prompt"] + out["usage"]["prompt_tokens"]
    assert (
        await sample("request_success_total", f'finished_reason="length",model_name="{MODEL}"')
        == before["ok"] + 1
    )
    assert await sample("time_to_first_token_seconds_count") == before["ttft"] + 1
    assert await sample("e2e_request_latency_seconds_count") == before["e2e"] + 1
    assert await sample("request_queue_time_seconds_count") == before["queue"] + 1
    assert await sample("prefix_cache_queries_total") > before["queries"]
    assert await sample("num_requests_running") == 0
    async with session.get(url + "metrics") as r:
        text = await r.text()
    for name in ("num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total", "num_preemptions_total",
                 "inter_token_latency_seconds_bucket", "iteration_tokens_total_bucket"):  # fmt: skip
        assert f"jaxserve:{name}" in text


async def test_openai_sdk_completions_and_chat(server, reference):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
    prompt = PROMPTS[11]
    completion = await client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS
    )
    assert completion.choices[0].text == reference[prompt][0]
    assert completion.usage.completion_tokens == len(reference[prompt][1])
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream]) == reference[prompt][0]

    messages = [{"role": "user", "content": prompt}]
    chat = await client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_completion_tokens=MAX_TOKENS,
        extra_body={"top_k": 5, "min_p": 0.0, "ignore_eos": True, "min_tokens": 2},
    )  # fmt: skip
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == MAX_TOKENS  # ignore_eos: runs to max tokens
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_completion_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == chat.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    models = await client.models.list()
    assert models.data[0].id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="missing", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=10_000)
    assert "10001" in str(info.value)
    await client.close()


async def test_seeded_sampling_is_reproducible(http):
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 8, "temperature": 1.0, "seed": 1234}
    (s1, a), (s2, b) = await asyncio.gather(
        post(http, "v1/completions", body), post(http, "v1/completions", body)
    )
    assert s1 == s2 == 200
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


async def test_prompt_tokens_details_count_prefix_cache_hits(make_server):
    server = await make_server(enable_prompt_tokens_details=True)
    from aiohttp import ClientSession

    prompt = "Once upon a time " + " ".join(PROMPTS[:5])  # unseen, and long enough for several pages
    async with ClientSession() as session:
        http = (session, str(server.make_url("/")))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        _, first = await post(http, "v1/completions", body)
        _, second = await post(http, "v1/completions", body)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"]
    assert cached % 8 == 0  # whole pages (block_size 8)
