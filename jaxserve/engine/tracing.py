"""Request traces over OpenTelemetry's OTLP (--otlp-traces-endpoint), as vLLM sends them.

Every finished request becomes one span, "llm_request" (kind SERVER), from its arrival to its
last token, with vLLM's gen_ai.* attributes: the request's id and sampling settings, its token
counts and its latencies (time in queue, to the first token, end to end). A request that came
with W3C trace headers (`traceparent`, `tracestate`) gets its span in the caller's trace.
Spans leave in batches from OpenTelemetry's own thread; the protocol is
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL's, grpc by default as in vLLM, or http/protobuf. The packages
come with `pip install 'jaxserve[otel]'`.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Iterable, Mapping

from jaxserve.engine.stats import FinishedRequestStats

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"
TRACE_HEADERS = ("traceparent", "tracestate")
EXPORTERS = {  # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL -> the module of its OTLPSpanExporter
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
}


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers among an HTTP request's, if any."""
    found = {h: headers[h] for h in TRACE_HEADERS if h in headers}
    return found or None


def exporter_class(protocol: str | None = None) -> type:
    """The OTLP span exporter for `protocol` (default: the environment's, else grpc); ValueError,
    one line, for an unknown protocol or when OpenTelemetry is not installed."""
    protocol = protocol or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol not in EXPORTERS:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r} is not supported; supported: {', '.join(EXPORTERS)}."
        )
    try:
        importlib.import_module("opentelemetry.sdk.trace")
        return importlib.import_module(EXPORTERS[protocol]).OTLPSpanExporter
    except ImportError as e:
        raise ValueError(
            f"--otlp-traces-endpoint needs OpenTelemetry ({e.name} is missing): pip install 'jaxserve[otel]'."
        ) from None


class RequestTracer:
    """Sends a span for each finished request to an OTLP endpoint."""

    def __init__(self, endpoint: str, model_name: str) -> None:
        from opentelemetry.propagators.textmap import DefaultGetter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider()
        self.provider.add_span_processor(BatchSpanProcessor(exporter_class()(endpoint=endpoint)))
        self._tracer = self.provider.get_tracer("jaxserve")
        self._propagator, self._getter = TraceContextTextMapPropagator(), DefaultGetter()
        self._kind = SpanKind.SERVER
        self.model_name = model_name
        logger.info("Sending request traces to %s", endpoint)

    def record(self, finished: Iterable[FinishedRequestStats]) -> None:
        """One span per finished request (its times are time.monotonic; spans take the epoch)."""
        epoch = time.time() - time.monotonic()
        for f in finished:
            context = None
            if f.trace_headers:
                context = self._propagator.extract(f.trace_headers, getter=self._getter)
            span = self._tracer.start_span(
                SPAN_NAME, context=context, kind=self._kind, start_time=_ns(f.arrival_time + epoch)
            )
            attributes = {
                "gen_ai.response.model": self.model_name,
                "gen_ai.request.id": f.request_id,
                "gen_ai.usage.prompt_tokens": f.num_prompt_tokens,
                "gen_ai.usage.completion_tokens": f.num_generation_tokens,
                "gen_ai.latency.e2e": f.e2e_latency,
                "gen_ai.response.finish_reason": f.finish_reason,
            }
            if f.sampling_params is not None:
                p = f.sampling_params
                attributes.update(
                    {
                        "gen_ai.request.temperature": p.temperature,
                        "gen_ai.request.top_p": p.top_p,
                        "gen_ai.request.n": p.n,
                    }
                )
                if p.max_tokens is not None:
                    attributes["gen_ai.request.max_tokens"] = p.max_tokens
            if f.queue_time is not None:
                attributes["gen_ai.latency.time_in_queue"] = f.queue_time
            if f.time_to_first_token is not None:
                attributes["gen_ai.latency.time_to_first_token"] = f.time_to_first_token
            span.set_attributes(attributes)
            span.end(end_time=_ns(f.arrival_time + f.e2e_latency + epoch))

    def shutdown(self) -> None:
        """Send what is still batched, then stop."""
        self.provider.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
