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
    spec: SpecDecodingStats | None = None  # cumulative; None: no speculative decoding
    num_swapped: int = 0  # requests whose KV waits in host memory (swap preemption)
    swap_out_bytes: int = 0  # cumulative: bytes of KV copied out to host memory

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
            spec=None if scheduler.spec_stats is None else scheduler.spec_stats.snapshot(),
            num_swapped=0 if scheduler.swap is None else len(scheduler.swap.swapped),
            swap_out_bytes=0 if scheduler.swap is None else scheduler.swap.bytes_out,
        )


@dataclass
class SpecDecodingStats:
    """Speculative decoding's counters, cumulative (vLLM's spec_decode_* metrics): rows fed
    proposals, tokens proposed, proposals kept, and kept at each position of a row's proposals."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def snapshot(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos)
        )

    def since(self, start: SpecDecodingStats | None) -> SpecDecodingStats:
        """The counts since `start` (an earlier snapshot; None: since the beginning)."""
        start = start or SpecDecodingStats()
        per_pos = list(self.accepted_per_pos)
        for i, n in enumerate(start.accepted_per_pos):
            per_pos[i] -= n
        return SpecDecodingStats(
            self.num_drafts - start.num_drafts,
            self.num_draft_tokens - start.num_draft_tokens,
            self.num_accepted_tokens - start.num_accepted_tokens,
            per_pos,
        )

    def line(self) -> str:
        """vLLM's SpecDecoding stats line for these counts."""
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        mean = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        per_pos = (
            ", ".join(f"{n / self.num_drafts:.3f}" for n in self.accepted_per_pos) if self.num_drafts else ""
        )
        return (
            f"SpecDecoding metrics: Mean acceptance length: {mean:.2f}, Accepted: {self.num_accepted_tokens} "
            f"tokens, Drafted: {self.num_draft_tokens} tokens, Per-position acceptance rate: {per_pos}, "
            f"Avg Draft acceptance rate: {100 * rate:.1f}%"
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
