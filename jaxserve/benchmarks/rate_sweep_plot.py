"""The picture of a request-rate sweep: latency and throughput against the rate (``--plot``).

Where it sits: after every rate of a run has been reported, when ``--plot`` asked for it. The
knee of the latency curve and the flattening of the throughput curve are what a sweep is for, and
a plot shows them at a glance where a stack of tables does not. matplotlib is optional, so it is
imported only here, and checked before the run starts (``matplotlib_figure``) so a missing
install fails fast rather than after a long benchmark.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jaxserve.benchmarks.benchmark_error import BenchmarkError
from jaxserve.benchmarks.report import rate_text


def plot_rate_sweep(runs: Sequence[tuple[float, dict]], path: str) -> None:
    """Latency (mean and p99 TTFT, mean TPOT) and output throughput against request rate.

    An infinite rate has no place on a numeric axis, so it is drawn one step past the highest
    finite rate and labelled "inf".
    """
    Figure = matplotlib_figure()
    finite = [rate for rate, _ in runs if not math.isinf(rate)]
    inf_x = max(finite) * 1.25 if finite else 1.0
    runs = sorted(runs, key=lambda run: run[0])
    xs = [inf_x if math.isinf(rate) else rate for rate, _ in runs]
    mean_ttft = [r["mean_ttft_ms"] for _, r in runs]
    p99_ttft = [_successful_percentile(r["ttfts"], r["errors"], 99) * 1000.0 for _, r in runs]
    mean_tpot = [r["mean_tpot_ms"] for _, r in runs]
    throughput = [r["output_throughput"] for _, r in runs]

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    latency_ax, throughput_ax = fig.subplots(1, 2)
    latency_ax.plot(xs, mean_ttft, "o-", label="mean TTFT")
    latency_ax.plot(xs, p99_ttft, "s--", label="p99 TTFT")
    latency_ax.plot(xs, mean_tpot, "^-", label="mean TPOT")
    latency_ax.set_ylabel("latency (ms)")
    latency_ax.legend()
    throughput_ax.plot(xs, throughput, "o-", color="tab:green")
    throughput_ax.set_ylabel("output throughput (tok/s)")
    for ax in (latency_ax, throughput_ax):
        ax.set_xlabel("request rate (req/s)")
        ax.set_xticks(xs, [rate_text(rate) for rate, _ in runs])
        ax.grid(alpha=0.3)
    fig.suptitle("Serving benchmark: request-rate sweep")
    try:
        fig.savefig(path, dpi=100)
    except OSError as err:
        raise BenchmarkError(f"cannot write the plot to {path}: {err}", 2) from None


def _successful_percentile(values: Sequence[float], errors: Sequence[str], p: float) -> float:
    ok = [v for v, err in zip(values, errors) if not err]
    return float(np.percentile(ok, p)) if ok else 0.0


def matplotlib_figure():
    """matplotlib's Figure (no pyplot: no GUI backend, no global state), or a clear error."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise BenchmarkError("--plot needs matplotlib: pip install matplotlib", 2) from None
    return Figure
