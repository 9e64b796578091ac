"""Prometheus metrics and the periodic stats log line.

Where it sits: at the end of every engine step the async engine passes a SchedulerStats
snapshot and the step's IterationStats here (on the event loop). `EngineMetrics` keeps
vLLM's metric set under the `jaxserve:` prefix (same names after the colon, so a vLLM
dashboard needs only the prefix changed); `StatsLogger` turns the same numbers into the
line a vLLM server logs every few seconds.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxserve.engine.stats import IterationStats, SchedulerStats

PREFIX = "jaxserve:"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


_ZERO = SchedulerStats(0, 0, 0.0, 0, 0, 0)


def _token_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class EngineMetrics:
    """vLLM's engine metrics; one instance per server, each in its own registry."""

    def __init__(
        self, model_name: str, max_model_len: int, max_num_batched_tokens: int, max_loras: int | None = None
    ):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be processed.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Requests whose KV waits in host memory.")
        self.swap_out_bytes = counter(
            "swap_out_bytes", "Bytes of KV copied out to host memory (swap preemption)."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.")
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Rows fed proposed tokens.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Proposed tokens fed.")
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Proposed tokens kept."
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens kept, by their position among a row's proposals.",
            ["model_name", "position"],
            registry=r,
        )
        self._request_success = Counter(
            PREFIX + "request_success",
            "Successfully finished requests.",
            labels + ["finished_reason"],
            registry=r,
        )
        self.model_name = model_name
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token in seconds.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between output tokens in seconds.", _ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency in seconds.", _E2E_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time requests spent waiting before first scheduled.", _E2E_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens per engine step.", _token_buckets(max_num_batched_tokens)
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", _token_buckets(max_model_len)
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Generated tokens per finished request.",
            _token_buckets(max_model_len),
        )
        # With LoRA: vLLM's info gauge, its labels the adapters of the running and the waiting
        # requests, its value when they were last seen. Only the current label set is kept (a
        # gauge per combination ever seen would grow with every mix of adapters).
        self._lora_info = None
        self._max_loras = str(max_loras)
        if max_loras is not None:
            self._lora_info = Gauge(
                PREFIX + "lora_requests_info",
                "Running stats on LoRA requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=r,
            )
        self._last = _ZERO

    def record(self, sched: SchedulerStats, it: IterationStats) -> None:
        self.num_requests_running.set(sched.num_running)
        self.num_requests_waiting.set(sched.num_waiting)
        self.kv_cache_usage.set(sched.kv_cache_usage)
        # The scheduler's counters are cumulative; Prometheus counters only go up by deltas.
        self.prefix_cache_queries.inc(max(sched.prefix_cache_queries - self._last.prefix_cache_queries, 0))
        self.prefix_cache_hits.inc(max(sched.prefix_cache_hits - self._last.prefix_cache_hits, 0))
        self.num_preemptions.inc(max(sched.num_preemptions - self._last.num_preemptions, 0))
        self.num_requests_swapped.set(sched.num_swapped)
        self.swap_out_bytes.inc(max(sched.swap_out_bytes - self._last.swap_out_bytes, 0))
        if sched.spec is not None:
            self._record_spec(sched.spec.since(self._last.spec))
        self._last = sched
        if self._lora_info is not None:
            self._lora_info.clear()
            self._lora_info.labels(
                self._max_loras, ",".join(sched.waiting_lora_adapters), ",".join(sched.running_lora_adapters)
            ).set_to_current_time()
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_scheduled_tokens:
            self.iteration_tokens.observe(it.num_scheduled_tokens)
        for ttft in it.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in it.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for done in it.finished:
            self._request_success.labels(self.model_name, done.finish_reason).inc()
            self.e2e_request_latency.observe(done.e2e_latency)
            if done.queue_time is not None:
                self.request_queue_time.observe(done.queue_time)
            self.request_prompt_tokens.observe(done.num_prompt_tokens)
            self.request_generation_tokens.observe(done.num_generation_tokens)

    def _record_spec(self, new) -> None:
        self.spec_decode_num_drafts.inc(new.num_drafts)
        self.spec_decode_num_draft_tokens.inc(new.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(new.num_accepted_tokens)
        for position, n in enumerate(new.accepted_per_pos):
            self.spec_decode_num_accepted_tokens_per_pos.labels(self.model_name, str(position)).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsLogger:
    """Throughput and cache numbers since the last line, as vLLM logs them."""

    def __init__(self) -> None:
        self._since = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last = _ZERO  # the newest snapshot
        self._window_start: SchedulerStats | None = None  # the snapshot before the window's first step

    def record(self, sched: SchedulerStats, it: IterationStats) -> None:
        self._prompt_tokens += it.num_prompt_tokens
        self._generation_tokens += it.num_generation_tokens
        if self._window_start is None:
            self._window_start = self._last
        self._last = sched

    def line(self) -> str | None:
        """The stats line for the window that ends now (None if the engine was idle
        throughout), and start a new window."""
        now = time.monotonic()
        elapsed, self._since = max(now - self._since, 1e-9), now
        sched, start = self._last, self._window_start
        self._window_start = None
        if start is None:
            return None
        queries = sched.prefix_cache_queries - start.prefix_cache_queries
        hits = sched.prefix_cache_hits - start.prefix_cache_hits
        line = (
            f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {sched.num_running} reqs, Waiting: {sched.num_waiting} reqs, "
            f"KV cache usage: {100 * sched.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        )
        if sched.spec is not None:
            spec = sched.spec.since(start.spec)
            if spec.num_drafts:
                line += "\n" + spec.line()
        self._prompt_tokens = self._generation_tokens = 0
        return line
