"""What one engine step did, for the metrics and the periodic stats log line.

LLMEngine.step() fills an IterationStats and a SchedulerStats snapshot after every step;
the async engine hands both to jaxserve.metrics. Plain data: nothing here knows about
Prometheus or logging.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # share of usable KV pages held by live requests, 0..1
    prefix_cache_queries: int  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # cumulative prompt tokens found there
    num_preemptions: int  # cumulative
    # LoRA adapters (names, each once) of the running and the waiting requests
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    @classmethod
    def of(cls, scheduler) -> SchedulerStats:
        """A snapshot of `scheduler` (an engine.Scheduler) now."""
        prefix = scheduler.prefix_cache_stats
        running_loras, waiting_loras = scheduler.lora_adapters()
        return cls(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=scheduler.kv_cache_usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=scheduler.num_preemptions,
            running_lora_adapters=running_loras,
            waiting_lora_adapters=waiting_loras,
        )


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float  # seconds from arrival to the last token
    num_prompt_tokens: int
    num_generation_tokens: int
    # for request traces (engine/tracing.py) and the queue-time metric
    request_id: str = ""
    arrival_time: float = 0.0  # on the engine's clock
    queue_time: float | None = None  # seconds from arrival until first scheduled (None: never)
    time_to_first_token: float | None = None  # seconds (None: no token came out)
    sampling_params: Any = None  # the request's SamplingParams
    trace_headers: Mapping[str, str] | None = None  # W3C trace context the request came with


@dataclass
class IterationStats:
    num_scheduled_tokens: int = 0  # tokens the step ran through the model
    num_prompt_tokens: int = 0  # prompts of requests whose first token came out this step
    num_generation_tokens: int = 0  # tokens sampled this step
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
