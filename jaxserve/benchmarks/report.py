"""What a serving benchmark run leaves behind: the printed table and the result JSON.

Where it sits: last in the flow, once per request rate, after ``metrics`` has reduced the run.
Both follow vLLM's `bench serve` (the table's labels and widths, the JSON's keys and default file
name), so output from jaxserve and from vLLM can be put side by side or fed to the same scripts.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from datetime import datetime

from jaxserve.benchmarks.benchmark_error import BenchmarkError
from jaxserve.benchmarks.metrics import METRICS, percentile_label

_REPORT_WIDTH = 50


def format_report(
    result: dict,
    *,
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
    percentiles: Sequence[float] = (99.0,),
    request_rate: float | None = None,
    max_concurrency: int | None = None,
) -> str:
    """The report in vLLM's layout: 40-column labels, a section per selected metric, times in ms."""

    def row(label: str, value) -> str:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<40} {text:<10}".rstrip()

    lines = [f"{' Serving Benchmark Result ':=^{_REPORT_WIDTH}}"]
    lines.append(row("Successful requests:", result["completed"]))
    lines.append(row("Failed requests:", result["failed"]))
    if request_rate is not None:
        lines.append(row("Request rate configured (RPS):", float(request_rate)))
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    lines += [
        row("Benchmark duration (s):", result["duration"]),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Request throughput (req/s):", result["request_throughput"]),
        row("Output token throughput (tok/s):", result["output_throughput"]),
        row("Total Token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for name in percentile_metrics:
        heading, short = METRICS[name]
        lines.append(f"{heading:-^{_REPORT_WIDTH}}")
        lines.append(row(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        lines.append(row(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        for p in percentiles:
            label = percentile_label(p)
            lines.append(row(f"P{label} {short} (ms):", result[f"p{label}_{name}_ms"]))
    lines.append("=" * _REPORT_WIDTH)
    return "\n".join(lines)


def result_record(
    result: dict,
    *,
    backend: str,
    model_id: str,
    tokenizer_id: str,
    num_prompts: int,
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    metadata: dict[str, str],
) -> dict:
    """vLLM's record: the run's settings and --metadata first, then the metrics and per-request lists."""
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    rate = rate_text(request_rate) if math.isinf(request_rate) else request_rate  # JSON has no infinity
    header = {
        "date": date,
        "backend": backend,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": num_prompts,
        "request_rate": rate,
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        **metadata,
    }
    return {**header, **result}


def result_path(
    result_dir: str | None,
    filename: str | None,
    *,
    backend: str,
    model_id: str,
    request_rate: float,
    max_concurrency: int | None,
    several: bool,
) -> str:
    """``filename`` (suffixed with the rate when ``several`` rates share it) or vLLM's default name."""
    if filename:
        name = filename
        if several:
            stem, ext = os.path.splitext(name)
            name = f"{stem}-{rate_text(request_rate)}qps{ext or '.json'}"
    else:
        name = result_filename(backend, model_id, request_rate, max_concurrency, datetime.now())
    return os.path.join(result_dir, name) if result_dir else name


def result_filename(
    backend: str, model_id: str, request_rate: float, max_concurrency: int | None, now: datetime
) -> str:
    """vLLM's default name: backend, rate, concurrency, model and time, so runs never overwrite."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency else ""
    base_model = os.path.basename(model_id.rstrip("/"))
    return f"{backend}-{rate_text(request_rate)}qps{concurrency}-{base_model}-{now:%Y%m%d-%H%M%S}.json"


def write_result(path: str, record: dict) -> None:
    """A path that cannot be written is the user's to fix (exit 2), not a failure of the server."""
    try:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError as err:
        raise BenchmarkError(f"cannot write the result to {path}: {err}", 2) from None


def rate_text(rate: float) -> str:
    """A request rate as vLLM writes it in file names and JSON: "inf", or the number without noise."""
    return "inf" if math.isinf(rate) else f"{rate:g}"
