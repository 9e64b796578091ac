"""Client mistakes get a 4xx with an OpenAI-style body and never hurt the engine; a
disconnected client frees its pages; an engine failure fails only the requests it hit."""

from __future__ import annotations

import asyncio
import json

import pytest
from server_inputs import MAX_TOKENS, MODEL, PROMPTS

from jaxserve.engine.llm_engine import LLMEngine


def assert_error(status: int, body: dict, expected_status: int, *words: str, param: str | None = None):
    assert status == expected_status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == expected_status and error["type"].endswith("Error")
    for word in words:
        assert word in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param


async def raw_post(http, path: str, data: bytes | str, headers=None):
    session, url = http
    async with session.post(
        url + path, data=data, headers=headers or {"Content-Type": "application/json"}
    ) as r:
        return r.status, await r.json()


BAD_BODIES = [
    # (path, body, status, words in the message, param)
    ("v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, ["gpt-4", "does not exist"], "model"),
    ("v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, ["gpt-4"], "model"),
    ("v1/completions", {"model": MODEL}, 400, ["prompt"], "prompt"),
    ("v1/completions", {"prompt": "x", "temperature": "hot"}, 400, ["temperature"], "temperature"),
    ("v1/completions", {"prompt": "x", "temperature": -1}, 400, ["temperature"], None),
    ("v1/completions", {"prompt": "x", "top_p": 0}, 400, ["top_p"], None),
    ("v1/completions", {"prompt": "x", "n": 0}, 400, ["n"], "n"),
    ("v1/completions", {"prompt": "x", "max_tokens": 0}, 400, ["max_tokens"], "max_tokens"),
    ("v1/completions", {"prompt": "x", "max_tokens": 300}, 400, ["256", "301", "300"], None),
    ("v1/completions", {"prompt": [5] * 256, "max_tokens": 1}, 400, ["256 tokens", "256 input tokens"], None),
    ("v1/completions", {"prompt": [], "max_tokens": 1}, 400, ["prompt"], None),
    ("v1/completions", {"prompt": [10**6], "max_tokens": 1}, 400, ["[0, 512)"], None),
    # found by fuzzing: token ids the tokenizer cannot even hold reached its decode (500)
    ("v1/completions", {"prompt": [-153, 3], "max_tokens": 1}, 400, ["[0, 512)"], None),
    ("v1/completions", {"prompt": [[3], [2**70]], "max_tokens": 1}, 400, ["[0, 512)"], None),
    ("v1/completions", {"prompt": "x", "logprobs": 21}, 400, ["logprobs of 21", "max allowed: 20"], None),
    ("v1/completions", {"prompt": "x", "logprobs": -1}, 400, ["logprobs"], "logprobs"),
    ("v1/completions", {"prompt": "x", "logprobs": 21, "stream": True}, 400, ["max allowed: 20"], None),
    ("v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, ["prompt logprobs of 21"], None),
    ("v1/completions", {"prompt": "x", "prompt_logprobs": 2, "stream": True}, 400, ["stream=True"],
     "prompt_logprobs"),
    ("v1/completions", {"prompt": "x", "logit_bias": {"abc": 5}}, 400, ["logit_bias", "'abc'"], "logit_bias"),
    ("v1/completions", {"prompt": "x", "logit_bias": {"512": 5}}, 400, ["logit_bias", "[0, 512)", "512"], None),
    ("v1/completions", {"prompt": "x", "logit_bias": {"5": "up"}}, 400, ["logit_bias"], "logit_bias"),
    ("v1/completions", {"prompt": "x", "allowed_token_ids": [3, 600]}, 400, ["allowed_token_ids", "600"], None),
    ("v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, ["allowed_token_ids", "empty"], None),
    ("v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, ["presence_penalty"], None),
    ("v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, ["stream"], None),
    ("v1/completions", {"prompt": "x", "use_beam_search": True, "n": 11}, 400, ["beam_width 11", "--max-logprobs"],
     None),
    ("v1/completions", {"prompt": "x", "n": 1, "best_of": 3, "stream": True}, 400, ["best_of"], "best_of"),
    ("v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, ["best_of", ">= n"], None),
    # each is a sequence with its own state: bounded, or one body could hold millions
    ("v1/completions", {"prompt": "x", "best_of": 10**7}, 400, ["best_of"], "best_of"),
    ("v1/completions", {"prompt": [[3]] * 2049, "max_tokens": 1}, 400, ["2049 prompts", "2048"], "prompt"),
    ("v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, ["min_tokens"], None),
    ("v1/completions", {"prompt": "x", "stop": [""]}, 400, ["stop"], None),
    ("v1/chat/completions", {"messages": []}, 400, ["messages"], "messages"),
    ("v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, ["role"], "messages"),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 999},
     400, ["256", "999"], None),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
     "top_logprobs": 21}, 400, ["top_logprobs", "20"], "top_logprobs"),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     ["when using `top_logprobs`, `logprobs` must be set to true"], "top_logprobs"),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-1": 1}}, 400,
     ["logit_bias", "[-1]"], None),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 25}, 400,
     ["prompt logprobs of 25", "--max-logprobs"], None),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}],
     "tool_choice": "auto"}, 400, ["tool"], None),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}}, 400,
     ["objec"], "response_format"),
    ("v1/completions", {"prompt": "x", "guided_regex": "a(b"}, 400, ["unclosed group"], "guided_regex"),
    ("v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, 400, ["guided_choice"],
     "guided_choice"),
    ("v1/completions", {"prompt": "x", "structured_outputs": {"choice": []}}, 400, ["choice"],
     "structured_outputs"),
    ("v1/completions", {"prompt": "x", "structured_outputs": {"json": {}, "regex": "a"}}, 400, ["exactly one"],
     "structured_outputs"),
    ("v1/completions", {"prompt": "x", "guided_json": "{not json"}, 400, ["not valid JSON"], "guided_json"),
    ("v1/completions", {"prompt": "x", "guided_grammar": "start: (", "max_tokens": 1}, 400, ["grammar"],
     "guided_grammar"),
    ("v1/completions", {"prompt": "x", "guided_grammar": ""}, 400, ["grammar"], "guided_grammar"),
    ("v1/completions", {"prompt": "x", "guided_json": {"type": "string", "pattern": "("}}, 400, ["unclosed"],
     "guided_json"),
    ("v1/completions", {"prompt": "x", "guided_regex": "a", "guided_decoding_backend": "xgrammar"}, 400,
     ["torch"], "guided_regex"),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, ["image_url"], None),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{% for %}"},
     400, ["template"], None),
    ("detokenize", {"tokens": [-1]}, 400, ["tokens"], None),
    ("tokenize", {"model": "gpt-4", "prompt": "x"}, 404, ["gpt-4"], "model"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,status,words,param", BAD_BODIES, ids=lambda v: None)
async def test_bad_requests_get_openai_errors(http, path, body, status, words, param):
    session, url = http
    async with session.post(url + path, json=body) as r:
        assert_error(r.status, await r.json(), status, *words, param=param)


async def test_malformed_bodies_and_unknown_routes(http):
    assert_error(*await raw_post(http, "v1/completions", "{not json"), 400, "JSON")
    assert_error(*await raw_post(http, "v1/completions", "[1, 2]"), 400, "object")
    assert_error(*await raw_post(http, "tokenize", "{not json"), 400, "not valid JSON")
    assert_error(*await raw_post(http, "tokenize", "[1, 2]"), 400, "object")
    assert_error(*await raw_post(http, "v1/completions", b"\xff\xfe"), 400)
    nan = '{"prompt": "x", "temperature": NaN}'  # Python's json reads it; the API must not
    assert_error(*await raw_post(http, "v1/completions", nan), 400, "temperature")
    session, url = http
    async with session.get(url + "v1/nothing-here") as r:
        assert_error(r.status, await r.json(), 404)
    async with session.get(url + "v1/completions") as r:
        assert_error(r.status, await r.json(), 405)


SURROGATE = "\\ud800 x"  # the JSON escape of a lone surrogate: valid JSON, not Unicode text


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("v1/completions", '{"prompt": "%s"}', "prompt"),
        ("v1/completions", '{"prompt": ["ok", "%s"]}', "prompt"),
        ("v1/completions", '{"prompt": "x", "stop": ["%s"]}', "stop"),
        ("v1/completions", '{"prompt": "x", "bad_words": ["%s"]}', "bad_words"),
        ("v1/chat/completions", '{"messages": [{"role": "user", "content": "%s"}]}', "messages"),
        ("v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
         "messages"),
        ("v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
         '"function": {"name": "f", "description": "%s"}}]}', "tools"),
        ("v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "response_format": '
         '{"type": "json_schema", "json_schema": {"name": "s", "schema": {"%s": 1}}}}', "response_format"),
        ("tokenize", '{"prompt": "%s"}', "prompt"),
        ("tokenize", '{"messages": [{"role": "user", "content": "%s"}]}', "messages"),
        ("detokenize", '{"tokens": [1], "model": "%s"}', "model"),
    ],
    ids=lambda v: None,
)  # fmt: skip
async def test_strings_that_are_not_unicode_are_refused_by_field(http, path, body, param):
    status, error = await raw_post(http, path, body % SURROGATE)
    assert_error(status, error, 400, "not valid Unicode", param=param)


async def test_only_json_bodies_are_read(http):
    body = json.dumps({"prompt": "x", "max_tokens": 2})
    for content_type in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "",
    ):
        for path in ("v1/completions", "v1/chat/completions", "tokenize", "detokenize"):
            status, error = await raw_post(http, path, body, headers={"Content-Type": content_type})
            assert_error(status, error, 415, "application/json")
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        status, out = await raw_post(http, "v1/completions", body, headers={"Content-Type": content_type})
        assert status == 200, out


@pytest.mark.parametrize("depth", [65, 100_000])
async def test_deeply_nested_bodies_are_400(http, depth):
    assert_error(*await raw_post(http, "v1/chat/completions", "[" * depth + "]" * depth), 400)
    for path, body in (
        ("v1/completions", '{"prompt": "x", "stop": ' + "[" * depth + "]" * depth + "}"),
        ("v1/chat/completions", '{"messages": [], "x": ' + '{"a": ' * depth + "1" + "}" * depth + "}"),
    ):
        assert_error(*await raw_post(http, path, body), 400, "nests deeper than 64")
    session, url = http
    async with session.get(url + "health") as r:
        assert r.status == 200


async def test_an_unexpected_error_is_a_500_without_internals(server, http, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("secret internal detail")

    monkeypatch.setattr(server.engine, "make_request", broken)
    session, url = http
    async with session.post(url + "v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
        body = await r.json()
    assert_error(r.status, body, 500, "Internal server error")
    assert "secret" not in json.dumps(body) and "KeyError" not in json.dumps(body)


async def test_oversized_body_is_413(make_server):
    from aiohttp import ClientSession

    server = await make_server(max_body_bytes=4096)
    async with ClientSession() as session:
        http = (session, str(server.make_url("/")))
        status, body = await raw_post(http, "v1/completions", json.dumps({"prompt": "x" * 10_000}))
        assert_error(status, body, 413, "too large")
        status, ok = await raw_post(http, "v1/completions", json.dumps({"prompt": "fine", "max_tokens": 2}))
        assert status == 200


async def test_engine_survives_a_burst_of_bad_requests(http, reference):
    session, url = http
    bad = [session.post(url + p, json=b) for p, b, *_ in BAD_BODIES]
    good = session.post(
        url + "v1/completions", json={"prompt": PROMPTS[1], "temperature": 0, "max_tokens": MAX_TOKENS}
    )
    responses = await asyncio.gather(*bad, good)
    assert [r.status for r in responses[:-1]] == [b[2] for b in BAD_BODIES]
    assert responses[-1].status == 200
    assert (await responses[-1].json())["choices"][0]["text"] == reference[PROMPTS[1]][0]
    for r in responses:
        r.release()
    async with session.get(url + "health") as r:
        assert r.status == 200


async def wait_until_idle(engine: LLMEngine, timeout: float = 30.0) -> None:
    bm = engine.scheduler.block_manager
    for _ in range(int(timeout / 0.05)):
        if not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_usable_blocks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"pages still held: {bm.num_usable_blocks - bm.num_free_blocks}")


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_aborts_and_frees_every_page(http, llm_engine, stream):
    session, url = http
    bm = llm_engine.scheduler.block_manager
    body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 200, "ignore_eos": True, "stream": stream}
    request = asyncio.ensure_future(session.post(url + "v1/completions", json=body))
    if stream:
        response = await request
        await response.content.readuntil(b"\n\n")  # the first chunk: the request is running
        assert bm.num_free_blocks < bm.num_usable_blocks
        response.close()  # drop the connection mid-stream
    else:
        for _ in range(400):
            if bm.num_free_blocks < bm.num_usable_blocks:
                break
            await asyncio.sleep(0.01)
        assert bm.num_free_blocks < bm.num_usable_blocks
        request.cancel()  # the client gives up and closes the connection
        with pytest.raises(asyncio.CancelledError):
            await request
    await wait_until_idle(llm_engine)
    async with session.get(url + "metrics") as r:
        assert 'finished_reason="abort"' in await r.text()


async def test_a_failed_step_fails_only_its_requests(server, http, llm_engine, reference, monkeypatch):
    runner = llm_engine.runner
    real_dispatch = runner.dispatch
    calls = {"n": 0}

    def flaky(sched, fill_bitmask=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device failure")
        return real_dispatch(sched, fill_bitmask)

    monkeypatch.setattr(runner, "dispatch", flaky)
    session, url = http
    # none of the prompt's pages cached: the failed step plans (and registers) them all, unwritten
    assert llm_engine.reset_prefix_cache()
    body = {"model": MODEL, "prompt": PROMPTS[8], **{"temperature": 0, "max_tokens": MAX_TOKENS}}
    async with session.post(url + "v1/completions", json=body) as r:
        error = await r.json()
        assert_error(r.status, error, 500, "engine failed")
        assert "injected" not in error["error"]["message"]  # the trace is in the log only
    async with session.post(url + "v1/completions", json=body) as r:
        assert r.status == 200
        assert (await r.json())["choices"][0]["text"] == reference[PROMPTS[8]][0]
    async with session.get(url + "health") as r:
        assert r.status == 200
    await wait_until_idle(llm_engine)


async def test_a_step_that_loses_the_kv_pool_rebuilds_it(server, http, llm_engine, reference, monkeypatch):
    runner = llm_engine.runner
    real_dispatch = runner.dispatch
    calls = {"n": 0}

    def loses_pool(sched, fill_bitmask=None):
        calls["n"] += 1
        if calls["n"] == 3:  # mid-stream: the donated pool is consumed, then the call fails
            runner.kv_pool.delete()
            raise RuntimeError("device lost the step")
        return real_dispatch(sched, fill_bitmask)

    monkeypatch.setattr(runner, "dispatch", loses_pool)
    session, url = http
    body = {"model": MODEL, "prompt": PROMPTS[10], "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True}
    async with session.post(url + "v1/completions", json=body) as r:
        text = await r.text()
    assert '"code": 500' in text and "engine failed" in text and text.endswith("data: [DONE]\n\n")
    assert "device lost the step" not in text
    assert not runner.kv_pool.is_deleted()
    body["stream"] = False
    async with session.post(url + "v1/completions", json=body) as r:
        assert (await r.json())["choices"][0]["text"] == reference[PROMPTS[10]][0]


async def test_health_is_503_when_the_engine_cannot_go_on(server, http, llm_engine, monkeypatch):
    runner = llm_engine.runner

    def broken(sched, fill_bitmask=None):
        runner.kv_pool.delete()
        raise RuntimeError("device gone")

    def cannot_rebuild():
        raise RuntimeError("out of device memory")

    monkeypatch.setattr(runner, "dispatch", broken)
    monkeypatch.setattr(runner, "reset_kv_pool", cannot_rebuild)
    session, url = http
    async with session.post(url + "v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
        assert r.status == 500
    async with session.get(url + "health") as r:
        assert_error(r.status, await r.json(), 503, "out of device memory")
    async with session.post(url + "v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
        assert_error(r.status, await r.json(), 500, "not running")
    monkeypatch.undo()
    runner.reset_kv_pool()  # leave the shared engine usable for the next tests
    llm_engine.scheduler.drop_all_kv()
