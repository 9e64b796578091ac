"""The serving benchmark's numbers: per-request timings reduced to vLLM's result dict.

Where it sits: after a run's requests have all come back (``client``) and before the report
prints them. The keys, units (ms) and per-request lists are vLLM's, so a result JSON from this
benchmark and one from vLLM's can be compared key by key. ``METRICS`` holds the latency metrics a
run can report percentiles for, in the report's order.

TPOT = (E2EL - TTFT) / (output tokens - 1): the decode rate a request saw after its first token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxserve.benchmarks.client import RequestOutput
from jaxserve.benchmarks.dataset import encode

# Metric key -> (report heading, short name); the order is the report's.
METRICS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration: float,
    *,
    tokenizer=None,
    percentiles: Sequence[float] = (99.0,),
) -> dict:
    """vLLM's result dict: totals, throughputs, mean/median/std/percentiles in ms, per-request lists.

    Output tokens come from the server's usage when it sent one; else from the tokenizer; else
    (no tokenizer either) one per text chunk, which is what most servers stream.
    """
    output_lens, ttfts, tpots, itls, e2els = [], [], [], [], []
    for out in outputs:
        if not out.success:
            output_lens.append(0)
            continue
        if out.output_tokens is not None:
            n = out.output_tokens
        elif tokenizer is not None:
            n = len(encode(tokenizer, out.generated_text))
        else:
            n = 1 + len(out.itl)
        output_lens.append(n)
        ttfts.append(out.ttft)
        itls.extend(out.itl)
        e2els.append(out.latency)
        if n > 1:
            tpots.append((out.latency - out.ttft) / (n - 1))
    completed = sum(out.success for out in outputs)
    total_input = sum(out.prompt_len for out in outputs if out.success)
    total_output = sum(output_lens)
    result = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name, seconds in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        empty = ms.size == 0  # every request failed: zeros rather than NaN warnings
        result[f"mean_{name}_ms"] = 0.0 if empty else float(np.mean(ms))
        result[f"median_{name}_ms"] = 0.0 if empty else float(np.median(ms))
        result[f"std_{name}_ms"] = 0.0 if empty else float(np.std(ms))
        for p in percentiles:
            result[f"p{percentile_label(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    result.update(
        input_lens=[out.prompt_len for out in outputs],
        output_lens=output_lens,
        ttfts=[out.ttft for out in outputs],
        itls=[out.itl for out in outputs],
        generated_texts=[out.generated_text for out in outputs],
        errors=[out.error for out in outputs],
    )
    return result


def percentile_label(p: float) -> str:
    """How a percentile appears in result keys and report rows: 99 as "99", 99.9 as "99.9"."""
    return str(int(p)) if float(p).is_integer() else str(p)
