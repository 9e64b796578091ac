"""POST /v1/embeddings and /pooling over a pooling model, through the OpenAI SDK and raw HTTP:
vectors equal transformers' pooled hidden states (floats and base64), inputs of every shape,
Matryoshka dimensions, truncation, the chat form; bad input and the wrong kind of model are 4xx."""

from __future__ import annotations

import base64
import re

import numpy as np
import openai
import pytest
import torch
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from reference_checks import assert_vectors_close, classifier_logits, pooled_reference
from tiny_models import engine_kwargs, make_classifier, make_family_checkpoint, make_reward_model

from jaxserve.args import EngineArgs
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints.openai.api_server import HANDLER_SETTINGS, build_app
from jaxserve.entrypoints.openai.server_args import ServerArgs

EMBEDDER = "tiny-embedder"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "hi"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(a MEAN-pooling engine over a tiny Qwen3 with Matryoshka sizes, the torch base model)."""
    path = tmp_path_factory.mktemp("embedder")
    base = make_family_checkpoint(path, "qwen3").model
    args = EngineArgs(
        model=str(path),
        served_model_name=[EMBEDDER],
        runner="pooling",
        pooler_config={"pooling_type": "MEAN"},
        **engine_kwargs(hf_overrides={"matryoshka_dimensions": [16, 64]}, max_model_len=40),
    )
    return LLMEngine.from_engine_args(args), base


async def serve(engine: LLMEngine) -> TestServer:
    server = TestServer(
        build_app(AsyncLLMEngine(engine), ServerArgs(disable_log_stats=True)),
        host="127.0.0.1",
        **HANDLER_SETTINGS,
    )
    await server.start_server()
    return server


@pytest.fixture
async def base_url(embedder):
    server = await serve(embedder[0])
    yield str(server.make_url("/"))
    await server.close()
    assert not embedder[0].has_unfinished_requests()


def expected(embedder, ids, dims=None, normalize=True):
    return pooled_reference(embedder[1], ids, "MEAN", normalize=normalize, dims=dims)


async def test_sdk_embeddings_equal_transformers(base_url, embedder):
    client = openai.AsyncOpenAI(base_url=base_url + "v1", api_key="unused", max_retries=0)
    tok = embedder[0].tokenizer
    for encoding_format in (openai.NOT_GIVEN, "float", "base64"):  # the SDK asks for base64 by default
        result = await client.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format=encoding_format)
        assert [d.index for d in result.data] == [0, 1, 2]
        for text, item in zip(TEXTS, result.data):
            vector = item.embedding
            if encoding_format == "base64":  # the SDK hands back what the server sent
                vector = np.frombuffer(base64.b64decode(vector), "<f4")
            assert_vectors_close(vector, expected(embedder, tok.encode(text)))
        assert result.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)
        assert result.usage.total_tokens == result.usage.prompt_tokens
    cut = await client.embeddings.create(model=EMBEDDER, input=TEXTS[0], dimensions=16)
    assert_vectors_close(cut.data[0].embedding, expected(embedder, tok.encode(TEXTS[0]), dims=16))
    with pytest.raises(openai.BadRequestError, match="only supports \\[16, 64\\] matryoshka dimensions"):
        await client.embeddings.create(model=EMBEDDER, input=TEXTS[0], dimensions=20)
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="no-such-model", input=TEXTS[0])
    await client.close()


async def test_raw_inputs_pooling_and_chat_form(base_url, embedder):
    tok = embedder[0].tokenizer
    ids = [tok.encode(t) for t in TEXTS]
    long_ids = tok.encode(" ".join(TEXTS * 3))
    assert len(long_ids) > 40
    async with ClientSession() as http:

        async def post(path, body):
            async with http.post(base_url + path, json=body) as r:
                return r.status, await r.json()

        status, body = await post("v1/embeddings", {"input": ids[0], "normalize": False})
        assert status == 200 and body["object"] == "list" and body["model"] == EMBEDDER
        assert body["data"][0]["object"] == "embedding" and body["id"].startswith("embd-")
        assert_vectors_close(body["data"][0]["embedding"], expected(embedder, ids[0], normalize=False))
        status, body = await post("pooling", {"model": EMBEDDER, "input": ids})
        assert status == 200 and [d["object"] for d in body["data"]] == ["pooling"] * 3
        for want, item in zip(ids, body["data"]):
            assert_vectors_close(item["data"], expected(embedder, want))
        status, body = await post("v1/embeddings", {"input": long_ids, "truncate_prompt_tokens": 12})
        assert status == 200 and body["usage"]["prompt_tokens"] == 12
        assert_vectors_close(body["data"][0]["embedding"], expected(embedder, long_ids[-12:]))
        messages = [{"role": "user", "content": TEXTS[1]}]
        status, body = await post("v1/embeddings", {"messages": messages})
        chat_ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
        chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
        assert status == 200 and body["usage"]["prompt_tokens"] == len(chat_ids)
        assert_vectors_close(body["data"][0]["embedding"], expected(embedder, list(chat_ids)))
        bad = [
            ({"input": long_ids}, "maximum context length is 40 tokens"),
            ({"input": []}, "must not be empty"),
            ({"input": TEXTS[0], "messages": messages}, "either `input` or `messages`"),
            ({"input": TEXTS[0], "dimensions": 0}, "matryoshka|greater than 0"),
            ({"input": TEXTS[0], "encoding_format": "int8"}, "encoding_format"),
            ({"input": [10**6]}, "Prompt token ids must be in"),
        ]
        for request, message in bad:
            status, body = await post("v1/embeddings", request)
            assert status == 400, (request, body)
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert re.search(message, body["error"]["message"]), (message, body)
        status, body = await post("v1/completions", {"prompt": TEXTS[0], "max_tokens": 2})
        assert status == 400 and "served for pooling" in body["error"]["message"]


async def test_a_generation_model_refuses_embeddings(http):
    session, url = http
    async with session.post(url + "v1/embeddings", json={"input": "hello"}) as r:
        assert r.status == 400
        assert "embeddings need a pooling model" in (await r.json())["error"]["message"]


async def test_score_and_rerank_rank_by_cosine_similarity(base_url, embedder):
    tok = embedder[0].tokenizer
    vector = {t: expected(embedder, tok.encode(t)) for t in TEXTS}

    def cos(a, b):
        return float(vector[a] @ vector[b] / (np.linalg.norm(vector[a]) * np.linalg.norm(vector[b])))

    async with ClientSession() as http:

        async def post(path, body):
            async with http.post(base_url + path, json=body) as r:
                return r.status, await r.json()

        cases = [  # one to one, one to many, pairwise
            ({"text_1": TEXTS[0], "text_2": TEXTS[1]}, [(0, 1)]),
            ({"text_1": TEXTS[0], "text_2": TEXTS}, [(0, 0), (0, 1), (0, 2)]),
            ({"text_1": TEXTS[:2], "text_2": TEXTS[1:]}, [(0, 1), (1, 2)]),
        ]
        for path in ("score", "v1/score"):
            for request, pairs in cases:
                status, body = await post(path, {"model": EMBEDDER, **request})
                assert status == 200 and body["object"] == "list", body
                assert [d["object"] for d in body["data"]] == ["score"] * len(pairs)
                want = [cos(TEXTS[a], TEXTS[b]) for a, b in pairs]
                np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-5)
        status, body = await post("score", {"text_1": TEXTS[:2], "text_2": TEXTS})
        assert status == 400 and "give one text_1, or as many" in body["error"]["message"]
        ranked = sorted(range(3), key=lambda i: -cos(TEXTS[1], TEXTS[i]))
        for path in ("rerank", "v1/rerank", "v2/rerank"):
            status, body = await post(path, {"query": TEXTS[1], "documents": TEXTS, "top_n": 2})
            assert status == 200, body
            assert [r["index"] for r in body["results"]] == ranked[:2]
            assert body["results"][0]["document"] == {"text": TEXTS[ranked[0]]}
            assert body["results"][0]["relevance_score"] == pytest.approx(
                cos(TEXTS[1], TEXTS[ranked[0]]), abs=1e-5
            )
            assert body["usage"]["total_tokens"] == sum(
                len(tok.encode(t)) for t in TEXTS
            )  # the query is a document
        status, body = await post(
            "rerank", {"query": TEXTS[1], "documents": TEXTS, "return_documents": False}
        )
        assert [r["index"] for r in body["results"]] == ranked and "document" not in body["results"][0]
        status, body = await post("rerank", {"query": TEXTS[1], "documents": []})
        assert status == 400 and body["error"]["param"] == "documents"


@pytest.fixture
async def classifier_url(tmp_path):
    """A server over a tiny three-label classifier: (its url, the torch model, the engine)."""
    model = make_classifier(tmp_path, "Qwen3ForSequenceClassification", ["neg", "neutral", "pos"])
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tmp_path), **engine_kwargs()))
    server = await serve(engine)
    yield str(server.make_url("/")), model, engine
    await server.close()


async def test_classify_probabilities_and_labels(classifier_url):
    url, model, engine = classifier_url
    tok = engine.tokenizer
    async with ClientSession() as http:
        async with http.post(url + "classify", json={"input": TEXTS}) as r:
            assert r.status == 200
            body = await r.json()
        assert body["id"].startswith("classify-") and body["usage"]["prompt_tokens"] == sum(
            len(tok.encode(t)) for t in TEXTS
        )
        for text, item in zip(TEXTS, body["data"]):
            logits = classifier_logits(model, tok.encode(text))
            probs = np.exp(logits) / np.exp(logits).sum()
            np.testing.assert_allclose(item["probs"], probs, rtol=1e-4, atol=1e-6)
            assert (
                item["num_classes"] == 3 and item["label"] == ["neg", "neutral", "pos"][int(np.argmax(probs))]
            )
        for path, request, message in [
            ("v1/embeddings", {"input": TEXTS[0]}, "served for classification"),
            ("classify", {"input": TEXTS[0], "dimensions": 4}, "apply to embeddings"),
            ("score", {"text_1": TEXTS[0], "text_2": TEXTS[1]}, "needs a cross-encoder"),
        ]:
            async with http.post(url + path, json=request) as r:
                assert r.status == 400 and message in (await r.json())["error"]["message"]


async def test_a_cross_encoder_scores_and_reranks_pairs_read_together(tmp_path):
    model = make_classifier(tmp_path, "LlamaForSequenceClassification", ["relevant"])
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tmp_path), **engine_kwargs()))
    server = await serve(engine)
    tok = engine.tokenizer
    want = [
        float(1 / (1 + np.exp(-classifier_logits(model, tok(TEXTS[0], t)["input_ids"])[0]))) for t in TEXTS
    ]
    async with ClientSession() as http:
        async with http.post(str(server.make_url("/score")), json={"text_1": TEXTS[0], "text_2": TEXTS}) as r:
            body = await r.json()
        np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-6)
        async with http.post(
            str(server.make_url("/v2/rerank")), json={"query": TEXTS[0], "documents": TEXTS}
        ) as r:
            body = await r.json()
        assert [x["index"] for x in body["results"]] == sorted(range(3), key=lambda i: -want[i])
    await server.close()


async def test_a_process_reward_model_over_pooling(tmp_path):
    """/pooling over a process reward model: each step tag's two-label probabilities (logits with
    use_activation false), in floats or base64; the endpoints of other tasks are 400s naming it."""
    base, (w0, b0, w2, b2) = make_reward_model(tmp_path, process=True)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tmp_path), **engine_kwargs()))
    tag = engine.tokenizer.encode(".")[0]
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tmp_path), pooler_config={"step_tag_id": tag}, **engine_kwargs())
    )
    server = await serve(engine)
    url = str(server.make_url("/"))
    text = "Step one: add. Step two: carry the one. Done."
    ids = engine.tokenizer.encode(text)
    with torch.no_grad():
        hidden = base(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    logits = (np.maximum(hidden @ w0.T + b0, 0) @ w2.T + b2)[np.asarray(ids) == tag]
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    async with ClientSession() as http:
        for request, want in [({"input": text}, probs), ({"input": text, "use_activation": False}, logits)]:
            async with http.post(url + "pooling", json=request) as r:
                assert r.status == 200
                body = await r.json()
            np.testing.assert_allclose(body["data"][0]["data"], want, rtol=1e-4, atol=1e-5)
            assert body["usage"]["prompt_tokens"] == len(ids)
        async with http.post(url + "pooling", json={"input": [text], "encoding_format": "base64"}) as r:
            data = base64.b64decode((await r.json())["data"][0]["data"])
        np.testing.assert_allclose(np.frombuffer(data, "<f4").reshape(-1, 2), probs, atol=1e-5)
        for path, request in [
            ("v1/embeddings", {"input": text}),
            ("classify", {"input": text}),
            ("score", {"text_1": text, "text_2": text}),
        ]:
            async with http.post(url + path, json=request) as r:
                assert r.status == 400 and "served for rewards" in (await r.json())["error"]["message"]
    await server.close()


async def test_pooling_requests_in_the_metrics(base_url, embedder):
    """Pooling requests count as finished requests (reason stop) and their prompts as prompt
    tokens; they generate none."""
    from prometheus_client.parser import text_string_to_metric_families

    from jaxserve.metrics import PREFIX

    tok = embedder[0].tokenizer
    async with ClientSession() as http:
        async with http.post(base_url + "v1/embeddings", json={"input": TEXTS}) as r:
            assert r.status == 200
        async with http.get(base_url + "metrics") as r:
            text = await r.text()
    samples = {
        (s.name, s.labels.get("finished_reason")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[(PREFIX + "prompt_tokens_total", None)] == sum(len(tok.encode(t)) for t in TEXTS)
    assert samples[(PREFIX + "generation_tokens_total", None)] == 0
    assert samples[(PREFIX + "request_success_total", "stop")] == len(TEXTS)
    assert samples[(PREFIX + "e2e_request_latency_seconds_count", None)] == len(TEXTS)


async def test_cohere_embed(base_url, embedder):
    """Cohere's /v2/embed: float and base64 encodings of the same vectors; truncate END keeps a long
    text's first tokens, START its last, NONE refuses it."""
    tok = embedder[0].tokenizer
    long_text = " ".join(TEXTS * 4)
    long_ids = tok.encode(long_text)
    assert len(long_ids) > 40
    async with ClientSession() as http:

        async def post(body):
            async with http.post(base_url + "v2/embed", json=body) as r:
                return r.status, await r.json()

        status, body = await post(
            {"texts": TEXTS, "embedding_types": ["float", "base64"], "input_type": "search_query"}
        )
        assert status == 200 and body["response_type"] == "embeddings_by_type" and body["texts"] == TEXTS
        for text, floats, packed in zip(TEXTS, body["embeddings"]["float"], body["embeddings"]["base64"]):
            assert_vectors_close(floats, expected(embedder, tok.encode(text)))
            np.testing.assert_array_equal(np.frombuffer(base64.b64decode(packed), "<f4"), np.float32(floats))
        assert body["meta"]["billed_units"]["input_tokens"] == sum(len(tok.encode(t)) for t in TEXTS)
        for truncate, ids in (("END", long_ids[:40]), ("START", long_ids[-40:])):
            status, body = await post({"texts": [long_text], "truncate": truncate})
            assert status == 200, body
            assert_vectors_close(body["embeddings"]["float"][0], expected(embedder, ids))
        status, body = await post({"texts": [long_text], "truncate": "NONE"})
        assert status == 400 and "maximum context length" in body["error"]["message"]
