"""The serving benchmark against a fake OpenAI-compatible server whose delays and token counts are known.

The fake streams ``max_tokens`` text chunks: the first after ``ttft`` seconds, the rest ``itl`` apart,
then a finish chunk and (when asked through stream_options) a usage chunk that claims
``tokens_per_chunk`` tokens per chunk, so counts taken from usage and counts taken from the text differ.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import sys
import time

import numpy as np
import pytest
from aiohttp import web
from tiny_models import make_tokenizer

from jaxserve.benchmarks import client, dataset, metrics, report, serving
from jaxserve.benchmarks.benchmark_error import BenchmarkError
from jaxserve.benchmarks.client import Target
from jaxserve.benchmarks.dataset import SampleRequest, load_tokenizer, sample_random_requests
from jaxserve.benchmarks.report import format_report
from jaxserve.benchmarks.serving import add_cli_args, benchmark, request_intervals

MODEL = "fake-model"


class FakeOpenAI:
    def __init__(
        self, ttft=0.05, itl=0.02, tokens_per_chunk=2, honour_usage=True, fail_requests=(), break_streams=()
    ):
        self.ttft, self.itl, self.tokens_per_chunk = ttft, itl, tokens_per_chunk
        self.honour_usage = honour_usage
        self.fail_requests = set(fail_requests)  # 1-based request numbers answered with HTTP 500
        self.break_streams = set(break_streams)  # 1-based request numbers whose stream carries an error
        self.bodies: list[dict] = []
        self.arrivals: list[float] = []
        self.headers: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(self, request):
        return await self.stream(request, chat=False)

    async def chat(self, request):
        return await self.stream(request, chat=True)

    async def stream(self, request, chat: bool):
        body = await request.json()
        self.arrivals.append(time.perf_counter())
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if len(self.bodies) in self.fail_requests:
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if chat:  # an empty role chunk first, as OpenAI sends: not a token
                await self.send(
                    resp, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                )
            n = body.get("max_completion_tokens" if chat else "max_tokens")
            for i in range(n):
                await asyncio.sleep(self.ttft if i == 0 else self.itl)
                piece = f" word{i}"
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                await self.send(resp, {"choices": [choice]})
                if len(self.bodies) in self.break_streams:
                    await self.send(resp, {"error": {"message": "engine died", "code": 500}})
                    break
            finish = {"index": 0, "finish_reason": "length"}
            finish.update({"delta": {}} if chat else {"text": ""})
            await self.send(resp, {"choices": [finish]})
            if self.honour_usage and (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 1, "completion_tokens": n * self.tokens_per_chunk}
                await self.send(resp, {"choices": [], "usage": usage})
        finally:
            self.in_flight -= 1
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    async def send(resp, payload):
        await resp.write(f"data: {json.dumps(payload)}\n\n".encode())


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-tokenizer")
    make_tokenizer(512).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


async def start(fake: FakeOpenAI, aiohttp_server):
    server = await aiohttp_server(fake.app())
    return str(server.make_url("")).rstrip("/")


def samples(n: int, output_len: int = 5) -> list[SampleRequest]:
    return [SampleRequest(f"prompt {i}", 3, output_len) for i in range(n)]


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(["--disable-tqdm", *argv])


# ---- arrival schedule ------------------------------------------------------------------------


def test_infinite_rate_sends_everything_at_once():
    np.testing.assert_array_equal(request_intervals(7, math.inf), np.zeros(7))


def test_poisson_intervals_are_seeded_with_the_requested_mean_and_shape():
    gaps = request_intervals(4000, 10.0, burstiness=1.0, seed=3)
    assert gaps.shape == (4000,) and gaps[0] == 0.0 and np.all(gaps[1:] > 0)
    np.testing.assert_array_equal(gaps, request_intervals(4000, 10.0, burstiness=1.0, seed=3))
    assert not np.array_equal(gaps, request_intervals(4000, 10.0, burstiness=1.0, seed=4))
    assert np.mean(gaps[1:]) == pytest.approx(0.1, rel=0.06)
    # Exponential gaps (Poisson arrivals) have a coefficient of variation of 1; gamma shape k gives 1/sqrt(k).
    assert np.std(gaps[1:]) / np.mean(gaps[1:]) == pytest.approx(1.0, abs=0.08)
    even = request_intervals(4000, 10.0, burstiness=4.0, seed=3)[1:]
    assert np.mean(even) == pytest.approx(0.1, rel=0.06)
    assert np.std(even) / np.mean(even) == pytest.approx(0.5, abs=0.05)


async def test_requests_arrive_on_the_seeded_schedule(aiohttp_server):
    fake = FakeOpenAI(ttft=0.001, itl=0.001)
    url = await start(fake, aiohttp_server)
    rate, n = 25.0, 8
    await benchmark(Target(url + "/v1/completions", MODEL), samples(n, 2), request_rate=rate, seed=5)
    assert len(fake.arrivals) == n
    # measured from the second arrival: the first also waits for the client's first connection,
    # which on a loaded machine makes every later offset look early by as much
    expected = np.cumsum(request_intervals(n, rate, seed=5))[1:]
    observed = np.array(fake.arrivals[1:]) - fake.arrivals[1]
    np.testing.assert_allclose(observed, expected - expected[0], atol=0.03)


# ---- metrics ---------------------------------------------------------------------------------


async def test_metrics_agree_with_the_server_delays_and_usage_counts(aiohttp_server):
    fake = FakeOpenAI(ttft=0.05, itl=0.02, tokens_per_chunk=2)
    url = await start(fake, aiohttp_server)
    n, out_len = 6, 5
    result = await benchmark(
        Target(url + "/v1/completions", MODEL), samples(n, out_len), percentiles=[50, 99]
    )
    assert result["completed"] == n and result["failed"] == 0 and len(fake.bodies) == n
    # Usage says 2 tokens per chunk; the text alone would say otherwise.
    assert result["output_lens"] == [out_len * 2] * n
    assert result["total_output_tokens"] == n * out_len * 2
    assert result["total_input_tokens"] == n * 3
    assert 48 <= result["mean_ttft_ms"] <= 110
    assert 18 <= result["mean_itl_ms"] <= 45
    assert all(len(itl) == out_len - 1 for itl in result["itls"])
    # TPOT = (E2EL - TTFT) / (tokens - 1): 4 gaps of 20 ms over 9 further tokens.
    assert 80 / 9 * 0.95 <= result["mean_tpot_ms"] <= 80 / 9 + 12
    assert 128 <= result["mean_e2el_ms"] <= 200
    assert result["median_ttft_ms"] <= result["p99_ttft_ms"]
    assert result["generated_texts"][0] == "".join(f" word{i}" for i in range(out_len))
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration"])


async def test_without_usage_the_text_is_tokenized(aiohttp_server, tokenizer):
    fake = FakeOpenAI(ttft=0.001, itl=0.001, honour_usage=False)
    url = await start(fake, aiohttp_server)
    result = await benchmark(Target(url + "/v1/completions", MODEL), samples(3), tokenizer=tokenizer)
    expected = len(tokenizer.encode(" word0 word1 word2 word3 word4", add_special_tokens=False))
    assert expected != 10  # differs from what usage would have claimed
    assert result["output_lens"] == [expected] * 3


async def test_completions_and_chat_bodies(aiohttp_server, monkeypatch):
    fake = FakeOpenAI(ttft=0.05, itl=0.001)
    url = await start(fake, aiohttp_server)
    sample = [SampleRequest("hello there", 2, 4)]
    await benchmark(Target(url + "/v1/completions", MODEL, "openai", api_key="sk-test"), sample)
    chat = await benchmark(
        Target(url + "/v1/chat/completions", MODEL, "openai-chat", ignore_eos=True), sample
    )
    completion_body, chat_body = fake.bodies
    assert completion_body["prompt"] == "hello there" and completion_body["max_tokens"] == 4
    assert "messages" not in completion_body and "ignore_eos" not in completion_body
    assert chat_body["messages"] == [{"role": "user", "content": "hello there"}]
    assert chat_body["max_completion_tokens"] == 4 and "prompt" not in chat_body
    assert chat_body["ignore_eos"] is True
    for body in fake.bodies:
        assert body["model"] == MODEL and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
    assert fake.headers[0]["Authorization"] == "Bearer sk-test"
    assert "Authorization" not in fake.headers[1]
    # The empty role chunk arrives at once; TTFT waits for the first content.
    assert chat["mean_ttft_ms"] >= 48
    assert chat["generated_texts"] == [" word0 word1 word2 word3"]


async def test_concurrency_never_exceeds_the_limit(aiohttp_server):
    fake = FakeOpenAI(ttft=0.02, itl=0.005)
    url = await start(fake, aiohttp_server)
    target = Target(url + "/v1/completions", MODEL)
    result = await benchmark(target, samples(8, 3), max_concurrency=2)
    assert result["completed"] == 8 and fake.max_in_flight == 2
    fake.max_in_flight = 0
    await benchmark(target, samples(8, 3))  # no limit, infinite rate: all at once
    assert fake.max_in_flight == 8


async def test_a_failing_request_is_counted_not_fatal(aiohttp_server):
    fake = FakeOpenAI(ttft=0.001, itl=0.001, fail_requests={3}, break_streams={5})
    url = await start(fake, aiohttp_server)
    result = await benchmark(Target(url + "/v1/completions", MODEL), samples(6), max_concurrency=1)
    assert result["completed"] == 4 and result["failed"] == 2
    assert len(result["ttfts"]) == 6 and result["output_lens"][2] == result["output_lens"][4] == 0
    assert "HTTP 500" in result["errors"][2] and "boom" in result["errors"][2]
    assert "engine died" in result["errors"][4]
    assert [bool(e) for e in result["errors"]] == [False, False, True, False, True, False]
    assert result["total_output_tokens"] == 4 * 5 * 2
    report = format_report(result)
    assert "Failed requests:                         2" in report


async def test_unreachable_server_fails_every_request():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = await benchmark(Target(f"http://127.0.0.1:{port}/v1/completions", MODEL), samples(2))
    assert result["completed"] == 0 and all("Connect" in e for e in result["errors"])
    assert result["mean_ttft_ms"] == 0.0


# ---- dataset ---------------------------------------------------------------------------------


def word_tokenizer():
    """Whole words, joined by spaces: decode and encode round-trip exactly, so lengths can be exact."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(200)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def test_random_prompts_have_the_drawn_lengths_and_a_shared_prefix():
    tok = word_tokenizer()
    kw = dict(input_len=30, output_len=10, range_ratio=0.5, prefix_len=5, seed=1)
    reqs = sample_random_requests(tok, 40, **kw)
    assert len(reqs) == 40 and sample_random_requests(tok, 40, **kw) == reqs
    assert sample_random_requests(tok, 40, **{**kw, "seed": 2}) != reqs
    words = [r.prompt.split() for r in reqs]
    assert all(r.prompt_len == len(w) for r, w in zip(reqs, words))
    assert all(5 + 15 <= r.prompt_len <= 5 + 45 for r in reqs) and len({r.prompt_len for r in reqs}) > 5
    assert (
        all(5 <= r.expected_output_len <= 15 for r in reqs) and len({r.expected_output_len for r in reqs}) > 3
    )
    assert len({tuple(w[:5]) for w in words}) == 1  # the shared prefix
    assert len({tuple(w[5:10]) for w in words}) == 40  # then each prompt its own
    assert not any(t in r.prompt for r in reqs for t in ("<unk>", "</s>"))
    fixed = sample_random_requests(tok, 10, input_len=30, output_len=10, seed=2)
    assert {(r.prompt_len, r.expected_output_len) for r in fixed} == {(30, 10)}


def test_byte_level_prompts_never_exceed_their_length(tokenizer):
    # Random byte tokens decode to replacement characters that re-encode wider; the count must hold.
    for r in sample_random_requests(tokenizer, 30, input_len=30, output_len=4, range_ratio=0.5, seed=1):
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert 0 < r.prompt_len <= 45


def test_default_model_name_falls_back_to_the_default_model_file(monkeypatch, tokenizer_dir):
    import jaxserve.model_resolution

    def resolve(model, revision=None):
        if model is None:
            return tokenizer_dir
        raise ValueError(f"model {model!r} is not local")

    monkeypatch.setattr(jaxserve.model_resolution, "resolve_model_path", resolve)
    assert len(load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")) > 100
    with pytest.raises(BenchmarkError) as err:
        load_tokenizer("someone/elses-model")
    assert err.value.exit_code == 2


# ---- command line ----------------------------------------------------------------------------


async def test_main_sweeps_rates_saves_results_and_plots(
    aiohttp_server, tokenizer_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    fake = FakeOpenAI(ttft=0.005, itl=0.002)
    url = await start(fake, aiohttp_server)
    ns = bench_args(
        "--base-url", url, "--tokenizer", tokenizer_dir, "--num-prompts", "4",
        "--random-input-len", "16", "--random-output-len", "3", "--request-rate", "100", "inf",
        "--metric-percentiles", "50,99.9", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--save-result", "--result-dir", str(tmp_path / "out"), "--result-filename", "run.json",
        "--metadata", "hardware=cpu", "--plot", str(tmp_path / "sweep.png"),
    )  # fmt: skip
    rc = await asyncio.to_thread(serving.main, ns)
    captured = capsys.readouterr()
    out = captured.out
    assert rc == 0, captured.err
    assert len(fake.bodies) == 1 + 2 * 4  # the test request, then every prompt once per rate
    assert {b["model"] for b in fake.bodies} == {MODEL}  # taken from /v1/models
    assert {h["Authorization"] for h in fake.headers} == {"Bearer sk-env"}
    assert out.count("============ Serving Benchmark Result ============") == 2
    for line in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                 "Total generated tokens:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Total Token throughput (tok/s):", "---------------Time to First Token----------------",
                 "-----Time per Output Token (excl. 1st token)------",
                 "---------------Inter-token Latency----------------",
                 "----------------End-to-end Latency----------------",
                 "P50 TTFT (ms):", "P99.9 E2EL (ms):", "Median ITL (ms):"):  # fmt: skip
        assert line in out
    for rate in ("100", "inf"):
        record = json.loads((tmp_path / "out" / f"run-{rate}qps.json").read_text())
        for key in ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
                    "max_concurrency", "duration", "completed", "total_input_tokens", "total_output_tokens",
                    "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                    "median_ttft_ms", "p99.9_ttft_ms", "p50_tpot_ms", "mean_itl_ms", "mean_e2el_ms",
                    "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"):  # fmt: skip
            assert key in record, key
        assert record["model_id"] == MODEL and record["tokenizer_id"] == tokenizer_dir
        assert record["completed"] == 4 and record["hardware"] == "cpu"
        assert record["total_output_tokens"] == 4 * 3 * 2
        assert record["request_rate"] == (100.0 if rate == "100" else "inf")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unsupported_dataset_is_refused_with_one_line(capsys):
    rc = serving.main(bench_args("--dataset-name", "sharegpt", "--dataset-path", "x.json", "--model", "m"))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "sharegpt" in err


@pytest.mark.parametrize(
    "argv",
    [["--metric-percentiles", "0"], ["--percentile-metrics", "ttft,latency"], ["--request-rate", "0"],
     ["--metadata", "novalue"], ["--backend", "openai-chat", "--endpoint", "/v1/completions"]],
)  # fmt: skip
def test_bad_arguments_exit_2(argv, capsys):
    assert serving.main(bench_args("--model", "m", *argv)) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_plot_without_matplotlib_is_refused_before_any_request(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    assert serving.main(bench_args("--port", "9", "--plot", "x.png")) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_unreachable_server_exits_1_with_one_line(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert serving.main(bench_args("--port", str(port))) == 1  # listing the models fails
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/v1/models" in err


async def test_failing_test_request_exits_1(aiohttp_server, tokenizer_dir, capsys):
    fake = FakeOpenAI(fail_requests={1})
    url = await start(fake, aiohttp_server)
    ns = bench_args("--base-url", url, "--model", MODEL, "--tokenizer", tokenizer_dir, "--num-prompts", "3",
                    "--random-input-len", "8", "--random-output-len", "2")  # fmt: skip
    assert await asyncio.to_thread(serving.main, ns) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "test request" in err and "HTTP 500" in err
    assert len(fake.bodies) == 1  # nothing else was sent


def test_serving_still_exports_the_names_imported_from_it():
    # `jaxserve bench serve` and benchmarks/serving.py import from serving, as may older scripts.
    assert callable(serving.add_cli_args) and callable(serving.main)
    homes = {
        "BACKEND_ENDPOINTS": client, "RequestOutput": client, "Target": client, "client_session": client,
        "fetch_model_id": client, "send_request": client, "DATASETS": dataset, "SampleRequest": dataset,
        "load_tokenizer": dataset, "sample_random_requests": dataset, "METRICS": metrics,
        "calculate_metrics": metrics, "format_report": report, "result_filename": report,
    }  # fmt: skip
    for name, home in homes.items():
        assert name in serving.__all__ and getattr(serving, name) is getattr(home, name), name
    assert serving.BenchmarkError is BenchmarkError
    for name in ("benchmark", "run_benchmark", "request_intervals", "plot_rate_sweep"):
        assert name in serving.__all__ and callable(getattr(serving, name)), name


def test_jaxserve_bench_serve_runs_this_benchmark(capsys):
    from jaxserve.cli import main as jaxserve_main

    assert jaxserve_main(["bench", "serve", "--dataset-name", "sharegpt"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sharegpt" in err and len(err.splitlines()) == 1
