"""LoRA adapters over HTTP: --lora-modules (name=path and JSON), listed by /v1/models with their
parent, selected by a request's `model` (completions and chat, streamed or not), and loaded and
unloaded at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING) with vLLM's answers. What each adapter
computes is proven against peft in tests/models/test_lora.py; here each request must get the
text the offline engine gives with the same adapter."""

from __future__ import annotations

import json

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from tiny_models import engine_kwargs, make_lora_adapter

from jaxserve.args import EngineArgs
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints.openai.api_server import HANDLER_SETTINGS, build_app
from jaxserve.entrypoints.openai.server_args import ServerArgs
from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import SamplingParams

PROMPT = [5, 17, 300, 42, 9, 77, 120]
TOKENS = 8


@pytest.fixture(scope="module")
def setup(tiny_llama_gqa, tmp_path_factory):
    """(engine, adapter paths, offline greedy token ids by adapter name, None for the base)."""
    path, base = tiny_llama_gqa
    paths = {}
    for i, (name, rank) in enumerate((("a", 8), ("b", 4), ("c", 16), ("big", 32))):
        paths[name] = str(tmp_path_factory.mktemp(f"server-lora-{name}"))
        make_lora_adapter(base, paths[name], rank, 2 * rank, ["q_proj", "v_proj", "down_proj"], 200 + i)
    args = EngineArgs(
        model=path, served_model_name=["tiny"], enable_lora=True, max_loras=2, **engine_kwargs()
    )
    engine = LLMEngine.from_engine_args(args)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    want = {}
    for i, name in enumerate((None, "a", "b", "c")):
        lora = None if name is None else LoRARequest(name, 100 + i, paths[name])
        engine.add_request(f"ref-{name}", {"prompt_token_ids": PROMPT}, params, lora_request=lora)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                want[out.request_id.removeprefix("ref-")] = out.outputs[0].token_ids
    assert len({tuple(v) for v in want.values()}) == 4
    return engine, paths, want


async def _serve(engine, **server_args):
    app = build_app(AsyncLLMEngine(engine), ServerArgs(disable_log_stats=True, **server_args))
    server = TestServer(app, host="127.0.0.1", **HANDLER_SETTINGS)
    await server.start_server()
    return server


async def _tokens(http, url, model, stream=False):
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "logprobs": 0, "stream": stream}  # fmt: skip
    async with http.post(url + "v1/completions", json=body) as r:
        if r.status != 200:
            return r.status, await r.json()
        if not stream:
            data = await r.json()
            return 200, [int(t.removeprefix("token_id:")) for t in data["choices"][0]["logprobs"]["tokens"]]
        ids = []
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: {"):
                ids += [
                    int(t.removeprefix("token_id:"))
                    for t in json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]
                ]
        return 200, ids


async def test_modules_are_listed_and_selected_by_model(setup):
    engine, paths, want = setup
    spec = json.dumps({"name": "b", "path": paths["b"], "base_model_name": "tiny"})
    server = await _serve(engine, lora_modules=[f"a={paths['a']}", spec])
    try:
        async with ClientSession() as http:
            url = str(server.make_url("/"))
            async with http.get(url + "v1/models") as r:
                models = {m["id"]: m for m in (await r.json())["data"]}
            assert models["a"]["parent"] == "tiny" and models["a"]["root"] == paths["a"]
            assert models["b"]["parent"] == "tiny" and models["tiny"]["parent"] is None
            assert (await _tokens(http, url, "tiny")) == (200, want["None"])
            assert (await _tokens(http, url, "a")) == (200, want["a"])
            assert (await _tokens(http, url, "b", stream=True)) == (200, want["b"])
            status, body = await _tokens(http, url, "c")
            assert status == 404 and body["error"]["message"] == "The model `c` does not exist."
            async with http.post(
                url + "v1/load_lora_adapter", json={"lora_name": "c", "lora_path": paths["c"]}
            ) as r:
                assert r.status == 404  # run-time loading is off unless allowed
    finally:
        await server.close()


async def test_adapters_load_and_unload_at_run_time(setup, monkeypatch):
    engine, paths, want = setup
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    server = await _serve(engine)
    try:
        async with ClientSession() as http:
            url = str(server.make_url("/"))

            async def post(path, body):
                async with http.post(url + path, json=body) as r:
                    return r.status, await r.text()

            assert await post("v1/load_lora_adapter", {"lora_name": "c", "lora_path": paths["c"]}) == (
                200, "Success: LoRA adapter 'c' added successfully.",
            )  # fmt: skip
            assert (await _tokens(http, url, "c")) == (200, want["c"])
            status, text = await post("v1/load_lora_adapter", {"lora_name": "c", "lora_path": paths["c"]})
            assert status == 400 and "has already been loaded" in text
            status, text = await post("v1/load_lora_adapter", {"lora_name": "big", "lora_path": paths["big"]})
            assert (
                status == 400
                and "rank 32 is greater than max_lora_rank 16" in json.loads(text)["error"]["message"]
            )
            status, text = await post("v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"})
            assert status == 400 and "not a PEFT LoRA adapter" in text
            async with http.get(url + "v1/models") as r:
                assert {m["id"] for m in (await r.json())["data"]} == {"tiny", "c"}
            assert await post("v1/unload_lora_adapter", {"lora_name": "c"}) == (
                200, "Success: LoRA adapter 'c' removed successfully.",
            )  # fmt: skip
            assert (await _tokens(http, url, "c"))[0] == 404
            status, text = await post("v1/unload_lora_adapter", {"lora_name": "c"})
            assert status == 404 and "cannot be found" in text
            assert (await _tokens(http, url, "tiny")) == (200, want["None"])
    finally:
        await server.close()


async def test_requests_survive_adapters_loaded_and_unloaded_under_load(setup, monkeypatch):
    """Requests on the base model and two adapters run while a third is loaded, used and
    unloaded (max_loras=2: adapters wait for slots and evict each other): every request gets
    its own text; the metrics name the adapters."""
    import asyncio

    engine, paths, want = setup
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    server = await _serve(engine, lora_modules=[f"a={paths['a']}", f"b={paths['b']}"])
    try:
        async with ClientSession() as http:
            url = str(server.make_url("/"))

            async def churn():
                got = []
                for _ in range(2):
                    async with http.post(
                        url + "v1/load_lora_adapter", json={"lora_name": "c", "lora_path": paths["c"]}
                    ) as r:
                        assert r.status == 200, await r.text()
                    got.append(await _tokens(http, url, "c"))
                    async with http.post(url + "v1/unload_lora_adapter", json={"lora_name": "c"}) as r:
                        assert r.status == 200, await r.text()
                return got

            models = ["tiny", "a", "b"] * 4
            results = await asyncio.gather(
                churn(), *(_tokens(http, url, m, stream=i % 2 == 1) for i, m in enumerate(models))
            )
            assert results[0] == [(200, want["c"])] * 2
            for model, result in zip(models, results[1:]):
                assert result == (200, want["None" if model == "tiny" else model]), model
            async with http.get(url + "metrics") as r:
                text = await r.text()
            (line,) = [x for x in text.splitlines() if x.startswith("jaxserve:lora_requests_info{")]
            assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line  # all done by now
    finally:
        await server.close()


def test_scheduler_stats_name_running_and_waiting_adapters(setup):
    """max_loras=2: requests on three adapters, the third waits for a slot; the stats say so."""
    engine, paths, _ = setup
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i, name in enumerate(("a", "b", "c")):
        lora = LoRARequest(name, 100 + i + 1, paths[name])
        engine.add_request(f"stats-{name}", {"prompt_token_ids": PROMPT}, params, lora_request=lora)
    engine.step()
    stats = engine.scheduler_stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (("a", "b"), ("c",))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.scheduler_stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == ((), ())
