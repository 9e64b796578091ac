"""Request traces (--otlp-traces-endpoint): an OTLP receiver in the test gets one "llm_request"
span per request, decoded with OpenTelemetry's own protobuf classes, over http/protobuf and grpc.
A request sent with a W3C traceparent header has its span in that trace, under that parent; the
span's times bracket the request as the client saw it, and its attributes are vLLM's gen_ai.*
with the request's own numbers."""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent import futures

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from tiny_models import engine_kwargs

from jaxserve import LLM, SamplingParams
from jaxserve.args import EngineArgs
from jaxserve.cli import main
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints.openai.api_server import HANDLER_SETTINGS, build_app
from jaxserve.entrypoints.openai.server_args import ServerArgs

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def _spans(requests: list) -> list:
    return [s for req in requests for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


def _attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


async def _http_receiver() -> tuple[TestServer, list]:
    received = []

    async def traces(request: web.Request) -> web.Response:
        message = trace_service_pb2.ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, received


async def test_a_served_request_is_a_span_in_the_callers_trace(tiny_llama_gqa, monkeypatch):
    receiver, received = await _http_receiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    endpoint = str(receiver.make_url("/v1/traces"))
    args = EngineArgs(
        model=tiny_llama_gqa[0], served_model_name=["tiny"], otlp_traces_endpoint=endpoint, **engine_kwargs()
    )
    engine = LLMEngine.from_engine_args(args)
    server = TestServer(
        build_app(AsyncLLMEngine(engine), ServerArgs(disable_log_stats=True)),
        host="127.0.0.1",
        **HANDLER_SETTINGS,
    )
    await server.start_server()
    body = {"model": "tiny", "prompt": [5, 17, 300, 42], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
            "ignore_eos": True}  # fmt: skip
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-Id": "traced"}
    try:
        async with ClientSession() as http:
            sent = time.time()
            async with http.post(str(server.make_url("/v1/completions")), json=body, headers=headers) as r:
                assert r.status == 200
                usage = (await r.json())["usage"]
            answered = time.time()
            async with http.post(str(server.make_url("/v1/completions")), json=body) as r:
                assert r.status == 200
        await asyncio.to_thread(engine.tracer.provider.force_flush)
    finally:
        await server.close()
        await receiver.close()
    spans = _spans(received)
    assert [s.name for s in spans] == ["llm_request", "llm_request"]
    traced, plain = spans
    assert traced.trace_id.hex() == TRACE_ID and traced.parent_span_id.hex() == PARENT_ID
    assert plain.trace_id.hex() != TRACE_ID and not plain.parent_span_id  # a trace of its own
    assert traced.kind == traced.SPAN_KIND_SERVER
    assert (
        sent - 0.05 <= traced.start_time_unix_nano / 1e9 <= traced.end_time_unix_nano / 1e9 <= answered + 0.05
    )
    a = _attributes(traced)
    assert a["gen_ai.request.id"] == "cmpl-traced" and a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"] == 4
    assert a["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 7
    assert a["gen_ai.request.max_tokens"] == 7 and a["gen_ai.request.n"] == 1
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5) and a[
        "gen_ai.request.top_p"
    ] == pytest.approx(0.9)
    e2e = (traced.end_time_unix_nano - traced.start_time_unix_nano) / 1e9
    assert a["gen_ai.latency.e2e"] == pytest.approx(e2e, abs=1e-3)
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= e2e
    assert a["gen_ai.response.finish_reason"] == "length"


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.received = []

    def Export(self, request, context):  # noqa: N802 (the service's own name)
        self.received.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_offline_requests_are_spans_over_grpc(tiny_llama_gqa, monkeypatch):
    import grpc

    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)  # grpc, vLLM's default
    try:
        llm = LLM(tiny_llama_gqa[0], otlp_traces_endpoint=f"http://127.0.0.1:{port}", **engine_kwargs())
        outs = llm.generate(
            [[5, 6, 7], [9, 10]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
        )
        llm.llm_engine.tracer.provider.force_flush()
    finally:
        server.stop(None)
    spans = {_attributes(s)["gen_ai.request.id"]: s for s in _spans(collector.received)}
    assert sorted(spans) == sorted(o.request_id for o in outs)
    for s in spans.values():
        assert s.name == "llm_request" and _attributes(s)["gen_ai.usage.completion_tokens"] == 3
    assert len({s.trace_id for s in spans.values()}) == 2  # each request its own trace


@pytest.mark.parametrize(
    "protocol, missing, message",
    [
        ("http/json", None, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL 'http/json' is not supported"),
        ("grpc", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "pip install 'jaxserve[otel]'"),
    ],
)
def test_tracing_that_cannot_run_stops_the_server_in_one_line(
    monkeypatch, capsys, protocol, missing, message
):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    if missing:
        monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    built = []
    monkeypatch.setattr("jaxserve.entrypoints.openai.api_server.run_server", lambda *a: built.append(a))
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--otlp-traces-endpoint", "http://127.0.0.1:4317"])
    assert exc.value.code == 2 and built == []
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], lines
