"""Online serving benchmark: load an OpenAI-compatible server the way vLLM's `bench serve` does.

Where it sits: outside the engine, on the far side of HTTP, so it measures what a client sees
(queueing, tokenization, scheduling, detokenization and SSE framing included) and works the same
against jaxserve or vLLM. The flags, the printed report and the saved JSON follow vLLM's, so runs
of the two servers can be compared line by line.

Flow: random-token prompts made with the served model's tokenizer (``dataset``) -> one test
request (``client``) -> for each request rate, streaming requests sent on a Poisson (gamma, with
``--burstiness``) arrival schedule, optionally capped by ``--max-concurrency`` (here) ->
per-request timings reduced to vLLM's numbers (``metrics``) -> table and JSON (``report``), and a
plot of the sweep (``rate_sweep_plot``). This module owns the command line and the arrival
schedule. `jaxserve bench serve`, benchmarks/serving.py and older scripts import the benchmark's
public names from here, so the other modules' ones are re-exported (``__all__``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxserve.benchmarks.benchmark_error import BenchmarkError
from jaxserve.benchmarks.client import (
    BACKEND_ENDPOINTS,
    RequestOutput,
    Target,
    client_session,
    fetch_model_id,
    send_request,
)
from jaxserve.benchmarks.dataset import DATASETS, SampleRequest, load_tokenizer, sample_random_requests
from jaxserve.benchmarks.metrics import METRICS, calculate_metrics
from jaxserve.benchmarks.rate_sweep_plot import matplotlib_figure, plot_rate_sweep
from jaxserve.benchmarks.report import (
    format_report,
    rate_text,
    result_filename,
    result_path,
    result_record,
    write_result,
)

__all__ = [
    "BACKEND_ENDPOINTS",
    "DATASETS",
    "METRICS",
    "BenchmarkError",
    "RequestOutput",
    "SampleRequest",
    "Target",
    "add_cli_args",
    "benchmark",
    "calculate_metrics",
    "client_session",
    "fetch_model_id",
    "format_report",
    "load_tokenizer",
    "main",
    "plot_rate_sweep",
    "request_intervals",
    "result_filename",
    "run_benchmark",
    "sample_random_requests",
    "send_request",
]


# ---------------------------------------------------------------------------------------------
# One benchmark run


def request_intervals(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Seconds to wait before each request: 0 for the first, then gamma-distributed gaps.

    The gaps have mean 1/request_rate and shape ``burstiness``: 1 is a Poisson process, below 1
    burstier, above 1 more even. An infinite rate sends everything at once (all zeros).
    """
    gaps = np.zeros(max(num_requests, 0))
    if num_requests <= 1 or math.isinf(request_rate):
        return gaps
    rng = np.random.default_rng(seed)
    gaps[1:] = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return gaps


async def benchmark(
    target: Target,
    requests: Sequence[SampleRequest],
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    tokenizer=None,
    percentiles: Sequence[float] = (99.0,),
    disable_tqdm: bool = True,
) -> dict:
    """Send ``requests`` on the arrival schedule and return the metrics and per-request lists.

    Requests are released at absolute offsets from the start, so a late wake-up does not push
    every later arrival back. The semaphore is taken after arrival, so with ``max_concurrency`` a
    request that arrives while the limit is reached waits on the client, as in vLLM.
    """
    offsets = np.cumsum(request_intervals(len(requests), request_rate, burstiness, seed))
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = None
    if not disable_tqdm:
        from tqdm import tqdm

        progress = tqdm(total=len(requests))

    async with client_session() as session:

        async def arrive(sample: SampleRequest, offset: float) -> RequestOutput:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is None:
                out = await send_request(session, target, sample)
            else:
                async with semaphore:
                    out = await send_request(session, target, sample)
            if progress is not None:
                progress.update(1)
            return out

        start = time.perf_counter()
        outputs = await asyncio.gather(*(arrive(s, float(o)) for s, o in zip(requests, offsets)))
        duration = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return calculate_metrics(outputs, duration, tokenizer=tokenizer, percentiles=percentiles)


def run_benchmark(target: Target, requests: Sequence[SampleRequest], **kwargs) -> dict:
    """:func:`benchmark` for callers without an event loop."""
    return asyncio.run(benchmark(target, requests, **kwargs))


# ---------------------------------------------------------------------------------------------
# Command line


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's `bench serve` flags, with their names and defaults."""
    add = parser.add_argument
    # fmt: off
    add("--backend", choices=sorted(BACKEND_ENDPOINTS), default="openai",
        help="API flavour: completions (openai, vllm) or chat completions (openai-chat).")
    add("--base-url", default=None, help="Server URL, e.g. http://host:8000; overrides --host and --port.")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--endpoint", default=None,
        help="API path; default /v1/completions, or /v1/chat/completions for openai-chat.")
    add("--model", default=None, help="Model name sent in requests; default: the first one the server lists.")
    add("--served-model-name", default=None,
        help="Name sent in requests when it differs from --model (which then names the tokenizer).")
    add("--tokenizer", default=None,
        help="Local tokenizer (directory, .gguf file or cached hub id); default: the model.")
    add("--dataset-name", default="random", help="Prompt source; only 'random' is supported.")
    add("--dataset-path", default=None, help="Unused by the random dataset.")
    add("--random-input-len", type=int, default=1024, help="Prompt tokens per request.")
    add("--random-output-len", type=int, default=128, help="max_tokens per request.")
    add("--random-range-ratio", type=float, default=0.0,
        help="Lengths are drawn from len * (1 +- ratio); 0 gives fixed lengths.")
    add("--random-prefix-len", type=int, default=0,
        help="Random tokens shared by every prompt, before its own input-len tokens.")
    add("--num-prompts", type=int, default=1000, help="Requests per request rate.")
    add("--request-rate", type=float, nargs="+", default=[math.inf], metavar="RATE",
        help="Requests per second (Poisson arrivals); inf sends all at once. Several rates run the "
        "benchmark once per rate.")
    add("--burstiness", type=float, default=1.0,
        help="Gamma shape of the arrival gaps: 1 is Poisson, <1 burstier, >1 more even.")
    add("--max-concurrency", type=int, default=None,
        help="Most requests in flight at once; later arrivals wait on the client.")
    add("--seed", type=int, default=0, help="Seeds the prompts and the arrival times.")
    add("--ignore-eos", action="store_true", help="Send ignore_eos so every request generates max_tokens.")
    add("--save-result", action="store_true", help="Write the result JSON (one file per rate).")
    add("--result-dir", default=None, help="Directory for the result JSON; default: the current one.")
    add("--result-filename", default=None,
        help="Result file name; with several rates each file gets a -<rate>qps suffix.")
    add("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="Extra fields for the result JSON.")
    add("--percentile-metrics", default="ttft,tpot,itl",
        help=f"Comma list of metrics to report percentiles for, from {','.join(METRICS)}.")
    add("--metric-percentiles", default="99", help="Comma list of percentiles, e.g. 50,90,99.")
    add("--disable-tqdm", action="store_true", help="No progress bar.")
    add("--plot", default=None, metavar="FILE.png",
        help="Plot latency and throughput against request rate (needs matplotlib).")
    # fmt: on


def main(ns: argparse.Namespace) -> int:
    """Run the benchmark for each request rate; 0 on success, else one line on stderr and 1 or 2."""
    try:
        return asyncio.run(_main(ns))
    except BenchmarkError as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)  # one line, whatever the server said
        return err.exit_code


@dataclass(frozen=True)
class _Options:
    """The checked command line: everything validated before the first byte goes out."""

    rates: list[float]
    percentile_metrics: list[str]
    percentiles: list[float]
    metadata: dict[str, str]
    base_url: str
    endpoint: str


def _check_args(ns: argparse.Namespace) -> _Options:
    def refuse(message: str):
        raise BenchmarkError(message, 2)

    if ns.dataset_name not in DATASETS:
        refuse(f"--dataset-name {ns.dataset_name!r} is not supported; only 'random' is")
    if ns.num_prompts < 1:
        refuse(f"--num-prompts must be at least 1, got {ns.num_prompts}")
    if ns.random_input_len < 1 or ns.random_output_len < 1 or ns.random_prefix_len < 0:
        refuse("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0")
    if not 0.0 <= ns.random_range_ratio < 1.0:
        refuse(f"--random-range-ratio must be in [0, 1), got {ns.random_range_ratio}")
    rates = ns.request_rate if isinstance(ns.request_rate, list) else [ns.request_rate]
    if any(not rate > 0 for rate in rates):
        refuse(f"--request-rate values must be > 0 (or inf), got {rates}")
    if not ns.burstiness > 0:
        refuse(f"--burstiness must be > 0, got {ns.burstiness}")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        refuse(f"--max-concurrency must be at least 1, got {ns.max_concurrency}")
    metrics = [m.strip() for m in ns.percentile_metrics.split(",") if m.strip()]
    if unknown := [m for m in metrics if m not in METRICS]:
        refuse(f"--percentile-metrics: unknown {','.join(unknown)}; choose from {','.join(METRICS)}")
    try:
        percentiles = [float(p) for p in ns.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        refuse(f"--metric-percentiles must be a comma list of numbers, got {ns.metric_percentiles!r}")
    if not percentiles or any(not 0 < p <= 100 for p in percentiles):
        refuse(f"--metric-percentiles must be in (0, 100], got {ns.metric_percentiles!r}")
    metadata = {}
    for item in ns.metadata or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            refuse(f"--metadata expects KEY=VALUE, got {item!r}")
        metadata[key] = value
    endpoint = ns.endpoint or BACKEND_ENDPOINTS[ns.backend]
    if ns.backend == "openai-chat" and not endpoint.rstrip("/").endswith("chat/completions"):
        refuse(f"--backend openai-chat needs a chat completions endpoint, got {endpoint}")
    if ns.plot:
        matplotlib_figure()  # fail now, not after a long run
    base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    return _Options(rates, metrics, percentiles, metadata, base_url, endpoint)


async def _main(ns: argparse.Namespace) -> int:
    opts = _check_args(ns)
    api_key = os.environ.get("OPENAI_API_KEY") or None
    model_id = ns.model or await fetch_model_id(opts.base_url, api_key)
    tokenizer_id = ns.tokenizer or model_id
    tokenizer = load_tokenizer(tokenizer_id)
    requests = sample_random_requests(
        tokenizer,
        ns.num_prompts,
        ns.random_input_len,
        ns.random_output_len,
        ns.random_range_ratio,
        ns.random_prefix_len,
        ns.seed,
    )
    target = Target(
        api_url=opts.base_url + opts.endpoint,
        model=ns.served_model_name or model_id,
        backend=ns.backend,
        ignore_eos=ns.ignore_eos,
        api_key=api_key,
    )

    print("Starting the initial single-prompt test run...")
    async with client_session() as session:
        test = await send_request(session, target, requests[0])
    if not test.success:
        raise BenchmarkError(f"test request to {target.api_url} failed: {test.error}")
    print("Initial test run completed. Starting the main benchmark run...")

    runs = []
    for rate in opts.rates:
        print(f"Traffic request rate: {rate_text(rate)}")
        kind = "Poisson process" if ns.burstiness == 1.0 else "Gamma distribution"
        print(f"Burstiness factor: {ns.burstiness} ({kind})")
        print(f"Maximum request concurrency: {ns.max_concurrency}")
        result = await benchmark(
            target,
            requests,
            request_rate=rate,
            burstiness=ns.burstiness,
            max_concurrency=ns.max_concurrency,
            seed=ns.seed,
            tokenizer=tokenizer,
            percentiles=opts.percentiles,
            disable_tqdm=ns.disable_tqdm,
        )
        report = format_report(
            result,
            percentile_metrics=opts.percentile_metrics,
            percentiles=opts.percentiles,
            request_rate=rate,
            max_concurrency=ns.max_concurrency,
        )
        print(report)
        if result["completed"] == 0:
            print("warning: every request failed; first error: " + result["errors"][0], file=sys.stderr)
        runs.append((rate, result))
        if ns.save_result:
            _save_result(ns, opts, model_id, tokenizer_id, rate, result)
    if ns.plot:
        plot_rate_sweep(runs, ns.plot)
        print(f"Saved the plot to {ns.plot}")
    return 0


def _save_result(
    ns: argparse.Namespace, opts: _Options, model_id: str, tokenizer_id: str, rate: float, result: dict
) -> None:
    """Written as soon as its rate finishes, so a sweep cut short keeps the rates it completed."""
    record = result_record(
        result,
        backend=ns.backend,
        model_id=model_id,
        tokenizer_id=tokenizer_id,
        num_prompts=ns.num_prompts,
        request_rate=rate,
        burstiness=ns.burstiness,
        max_concurrency=ns.max_concurrency,
        metadata=opts.metadata,
    )
    path = result_path(
        ns.result_dir,
        ns.result_filename,
        backend=ns.backend,
        model_id=model_id,
        request_rate=rate,
        max_concurrency=ns.max_concurrency,
        several=len(opts.rates) > 1,
    )
    write_result(path, record)
    print(f"Saved the result to {path}")
