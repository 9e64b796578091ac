"""The stats log line and the Prometheus counters, fed with known step statistics."""

from __future__ import annotations

from jaxserve.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats
from jaxserve.metrics import EngineMetrics, StatsLogger


def _sched(queries: int, hits: int, preemptions: int = 0) -> SchedulerStats:
    return SchedulerStats(
        num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=queries,
        prefix_cache_hits=hits, num_preemptions=preemptions,
    )  # fmt: skip


def test_stats_line_reports_the_window_since_the_last_line():
    stats = StatsLogger()
    assert stats.line() is None  # idle: nothing to say
    stats.record(_sched(100, 0), IterationStats(num_prompt_tokens=100, num_generation_tokens=4))
    stats.record(_sched(200, 50), IterationStats(num_generation_tokens=4))
    line = stats.line()
    assert "Running: 3 reqs, Waiting: 2 reqs" in line and "KV cache usage: 25.0%" in line
    assert "Prefix cache hit rate: 25.0%" in line  # 50 hits of 200 queried tokens
    assert "Avg prompt throughput: 0.0" not in line and "Avg generation throughput: 0.0" not in line
    stats.record(_sched(300, 150), IterationStats())
    assert "Prefix cache hit rate: 100.0%" in stats.line()  # only the new window counts


def test_counters_take_deltas_of_cumulative_scheduler_numbers():
    metrics = EngineMetrics("m", max_model_len=256, max_num_batched_tokens=64)
    done = FinishedRequestStats("stop", e2e_latency=0.5, num_prompt_tokens=10, num_generation_tokens=3)
    metrics.record(_sched(10, 0, 1), IterationStats(num_scheduled_tokens=10, time_to_first_tokens=[0.1]))
    metrics.record(_sched(30, 16, 2), IterationStats(num_generation_tokens=3, finished=[done]))
    text = metrics.render().decode()

    def value(name: str) -> float:
        (line,) = [x for x in text.splitlines() if x.startswith(f"jaxserve:{name}")]
        return float(line.rsplit(" ", 1)[1])

    assert value("prefix_cache_queries_total{") == 30 and value("prefix_cache_hits_total{") == 16
    assert value("num_preemptions_total{") == 2
    assert value('request_success_total{finished_reason="stop"') == 1
    assert value("time_to_first_token_seconds_count{") == 1
    assert value("request_generation_tokens_sum{") == 3
    assert value("num_requests_waiting{") == 2
