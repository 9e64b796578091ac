"""Online serving benchmark: load an OpenAI-compatible server the way vLLM's `bench serve` does.

Where it sits: outside the engine, on the far side of HTTP, so it measures what a client sees
(queueing, tokenization, scheduling, detokenization and SSE framing included) and works the same
against jaxserve or vLLM. The flags, the printed report and the saved JSON follow vLLM's, so runs
of the two servers can be compared line by line.

Flow: random-token prompts made with the served model's tokenizer -> one test request -> for each
request rate, streaming requests sent on a Poisson (gamma, with ``--burstiness``) arrival schedule,
optionally capped by ``--max-concurrency`` -> per-request timings -> report, JSON, plot.

Timings per request: TTFT is the arrival of the first chunk that carries text (a chat stream's
empty role chunk does not count), ITL the gaps between later text chunks, E2EL the end of the
stream, and TPOT = (E2EL - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import aiohttp
import numpy as np

# Default endpoint per backend; "vllm" is vLLM's own name for its completions client.
BACKEND_ENDPOINTS = {
    "openai": "/v1/completions",
    "vllm": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
DATASETS = ("random",)
# Metric key -> (report heading, short name); the order is the report's.
METRICS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
_REPORT_WIDTH = 50
# Decode/encode round trips spent steering a random prompt onto its token count.
_LENGTH_ROUNDS = 10
# A long benchmark at a low rate can keep a request queued for a long time; only a hung server
# should trip this.
_REQUEST_TIMEOUT_S = 6 * 60 * 60


class BenchmarkError(Exception):
    """A one-line reason to stop. exit_code 2: bad arguments; 1: the server cannot be benchmarked."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


@dataclass(frozen=True)
class Target:
    """Where requests go and how their bodies look; the same for every request of a run."""

    api_url: str
    model: str
    backend: str = "openai"
    ignore_eos: bool = False
    api_key: str | None = None

    def body(self, sample: SampleRequest) -> dict:
        body: dict = {"model": self.model, "temperature": 0.0, "stream": True}
        # Token counts from the server beat re-tokenizing the text: they see what was generated.
        body["stream_options"] = {"include_usage": True}
        if self.backend == "openai-chat":
            body["messages"] = [{"role": "user", "content": sample.prompt}]
            body["max_completion_tokens"] = sample.expected_output_len
        else:
            body["prompt"] = sample.prompt
            body["max_tokens"] = sample.expected_output_len
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extra field: every request runs to max_tokens
        return body

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestOutput:
    """What one request measured; a failed request keeps its error and counts zero tokens."""

    prompt_len: int = 0
    success: bool = False
    generated_text: str = ""
    output_tokens: int | None = None  # the server's usage.completion_tokens, when it sent one
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds, one per text chunk after the first
    latency: float = 0.0  # seconds, request sent -> stream ended
    error: str = ""


# ---------------------------------------------------------------------------------------------
# Dataset


def sample_random_requests(
    tokenizer,
    num_prompts: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts of random token ids decoded to text, as vLLM's random dataset.

    Random ids make prompts whose length is known and whose prefix no cache can share (except the
    deliberate shared prefix of ``prefix_len`` tokens). Lengths are drawn uniformly from
    length * (1 +- range_ratio). Each prompt's recorded length is that of the text actually sent,
    re-encoded; it matches the drawn length unless the round trip never settles (byte-level
    vocabularies full of partial characters), and is then the closest shorter one found.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    vocab = _ordinary_token_ids(tokenizer)
    input_lens = _random_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _random_lengths(rng, output_len, range_ratio, num_prompts)
    prefix = rng.choice(vocab, size=prefix_len)
    samples = []
    for n_in, n_out in zip(input_lens, output_lens):
        ids = np.concatenate([prefix, rng.choice(vocab, size=int(n_in))])
        prompt, prompt_len = _decode_to_length(tokenizer, ids, prefix_len + int(n_in), vocab, rng)
        samples.append(SampleRequest(prompt, prompt_len, int(n_out)))
    return samples


def _ordinary_token_ids(tokenizer) -> np.ndarray:
    """All ids but the special ones, which a server may strip or treat as end of text."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def _random_lengths(rng: np.random.Generator, length: int, range_ratio: float, n: int) -> np.ndarray:
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def _decode_to_length(
    tokenizer, ids: np.ndarray, target: int, vocab: np.ndarray, rng: np.random.Generator
) -> tuple[str, int]:
    """Text that re-encodes to ``target`` tokens, or else the closest shorter one a few rounds found
    (the last one tried if none was shorter), with its true token count.

    Decoding random ids and encoding the text again merges some tokens and splits others (cut
    byte sequences decode to wider replacement characters), so the ids are topped up with fresh
    random ones, or cut by the overshoot, until the round trip lands on the target.
    """
    best = None
    for _ in range(_LENGTH_ROUNDS):
        text = tokenizer.decode(ids.tolist())
        reencoded = np.asarray(_encode(tokenizer, text), dtype=np.int64)
        length = len(reencoded)
        if length == target:
            return text, length
        if length < target:
            if best is None or length > best[1]:
                best = (text, length)
            ids = np.concatenate([reencoded, rng.choice(vocab, size=target - length)])
        else:
            ids = reencoded[: max(1, 2 * target - length)]
    return best or (text, length)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def load_tokenizer(name: str):
    """The tokenizer for ``name``, found locally only (a directory, a .gguf file or the HF cache).

    The default model is served under its hub name but stored here as a GGUF file, so that name
    falls back to the file when the hub cache does not have it.
    """
    from jaxserve.args import resolve_model_path
    from jaxserve.loader.default_model import DEFAULT_MODEL_NAME
    from jaxserve.loader.tokenizer import get_tokenizer

    try:
        path = resolve_model_path(name)
    except ValueError as err:
        if name != DEFAULT_MODEL_NAME:
            raise BenchmarkError(f"tokenizer: {err} Pass --tokenizer with a local path.", 2) from None
        try:
            path = resolve_model_path(None)
        except ValueError as fetch_err:
            raise BenchmarkError(f"tokenizer for {name}: {fetch_err}", 2) from None
    try:
        return get_tokenizer(path)
    except ValueError as err:
        raise BenchmarkError(f"tokenizer: {err}", 2) from None


# ---------------------------------------------------------------------------------------------
# Requests


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


def client_session() -> aiohttp.ClientSession:
    # No connection limit: the arrival schedule and the semaphore decide what is in flight.
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S),
        connector=aiohttp.TCPConnector(limit=0),
    )


async def send_request(
    session: aiohttp.ClientSession, target: Target, sample: SampleRequest
) -> RequestOutput:
    """Send one streaming request and time its chunks. Never raises: failures become the output's error."""
    out = RequestOutput(prompt_len=sample.prompt_len)
    start = time.perf_counter()
    last_text_at = None
    try:
        async with session.post(target.api_url, json=target.body(sample), headers=target.headers()) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            async for arrived, data in _sse_events(resp):
                if "error" in data:
                    out.error = f"error in stream: {json.dumps(data['error'])[:500]}"
                    return out
                if usage := data.get("usage"):
                    out.output_tokens = usage.get("completion_tokens", out.output_tokens)
                text = _chunk_text(data, target.backend)
                if not text:
                    continue
                if last_text_at is None:
                    out.ttft = arrived - start
                else:
                    out.itl.append(arrived - last_text_at)
                last_text_at = arrived
                out.generated_text += text
    except Exception as err:  # a failed request is a result to report, not a reason to stop the run
        out.error = f"{type(err).__name__}: {err}"
        return out
    out.latency = time.perf_counter() - start
    if last_text_at is None:
        out.error = "the stream ended without any generated text"
    else:
        out.success = True
    return out


async def _sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, dict]]:
    """(arrival time, JSON payload) for each ``data:`` line, until ``[DONE]`` or the end of the body.

    Lines are reassembled across network reads; a line is timed by the read that completed it.
    """
    buffer = b""
    async for chunk in resp.content.iter_any():
        arrived = time.perf_counter()
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            payload = _sse_payload(line)
            if payload == b"[DONE]":
                return
            if payload is not None:
                yield arrived, json.loads(payload)
    payload = _sse_payload(buffer)
    if payload is not None and payload != b"[DONE]":
        yield time.perf_counter(), json.loads(payload)


def _sse_payload(line: bytes) -> bytes | None:
    line = line.strip()
    if not line.startswith(b"data:"):
        return None  # blank separators, comments, event names
    return line[len(b"data:") :].strip()


def _chunk_text(data: dict, backend: str) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    if backend == "openai-chat":
        delta = choices[0].get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choices[0].get("text") or ""


# ---------------------------------------------------------------------------------------------
# One benchmark run


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
            n = len(_encode(tokenizer, out.generated_text))
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
            result[f"p{_percentile_label(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    result.update(
        input_lens=[out.prompt_len for out in outputs],
        output_lens=output_lens,
        ttfts=[out.ttft for out in outputs],
        itls=[out.itl for out in outputs],
        generated_texts=[out.generated_text for out in outputs],
        errors=[out.error for out in outputs],
    )
    return result


def _percentile_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


# ---------------------------------------------------------------------------------------------
# Report, JSON, plot


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
            label = _percentile_label(p)
            lines.append(row(f"P{label} {short} (ms):", result[f"p{label}_{name}_ms"]))
    lines.append("=" * _REPORT_WIDTH)
    return "\n".join(lines)


def result_filename(
    backend: str, model_id: str, request_rate: float, max_concurrency: int | None, now: datetime
) -> str:
    """vLLM's default name: backend, rate, concurrency, model and time, so runs never overwrite."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency else ""
    base_model = os.path.basename(model_id.rstrip("/"))
    return f"{backend}-{_rate_text(request_rate)}qps{concurrency}-{base_model}-{now:%Y%m%d-%H%M%S}.json"


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def plot_rate_sweep(runs: Sequence[tuple[float, dict]], path: str) -> None:
    """Latency (mean and p99 TTFT, mean TPOT) and output throughput against request rate.

    An infinite rate has no place on a numeric axis, so it is drawn one step past the highest
    finite rate and labelled "inf".
    """
    Figure = _matplotlib_figure()
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
        ax.set_xticks(xs, [_rate_text(rate) for rate, _ in runs])
        ax.grid(alpha=0.3)
    fig.suptitle("Serving benchmark: request-rate sweep")
    try:
        fig.savefig(path, dpi=100)
    except OSError as err:
        raise BenchmarkError(f"cannot write the plot to {path}: {err}", 2) from None


def _successful_percentile(values: Sequence[float], errors: Sequence[str], p: float) -> float:
    ok = [v for v, err in zip(values, errors) if not err]
    return float(np.percentile(ok, p)) if ok else 0.0


def _matplotlib_figure():
    """matplotlib's Figure (no pyplot: no GUI backend, no global state), or a clear error."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise BenchmarkError("--plot needs matplotlib: pip install matplotlib", 2) from None
    return Figure


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
        _matplotlib_figure()  # fail now, not after a long run
    base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    return _Options(rates, metrics, percentiles, metadata, base_url, endpoint)


async def fetch_model_id(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at /v1/models, as vLLM picks it when --model is not given."""
    url = f"{base_url}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with client_session() as session, session.get(url, headers=headers) as resp:
            if resp.status != 200:
                raise BenchmarkError(f"GET {url} returned HTTP {resp.status}; pass --model")
            listing = await resp.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        raise BenchmarkError(f"cannot list the models at {url} ({type(err).__name__}: {err})") from None
    models = listing.get("data") if isinstance(listing, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise BenchmarkError(f"{url} lists no models; pass --model")
    return models[0]["id"]


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
        print(f"Traffic request rate: {_rate_text(rate)}")
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
    """vLLM's record: the run's settings and --metadata first, then the metrics and per-request lists."""
    header = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": ns.backend,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": ns.num_prompts,
        "request_rate": _rate_text(rate) if math.isinf(rate) else rate,  # JSON has no infinity
        "burstiness": ns.burstiness,
        "max_concurrency": ns.max_concurrency,
        **opts.metadata,
    }
    path = _result_path(ns, model_id, rate, several=len(opts.rates) > 1)
    _write_json(path, {**header, **result})
    print(f"Saved the result to {path}")


def _result_path(ns: argparse.Namespace, model_id: str, rate: float, *, several: bool) -> str:
    if ns.result_filename:
        name = ns.result_filename
        if several:
            stem, ext = os.path.splitext(name)
            name = f"{stem}-{_rate_text(rate)}qps{ext or '.json'}"
    else:
        name = result_filename(ns.backend, model_id, rate, ns.max_concurrency, datetime.now())
    return os.path.join(ns.result_dir, name) if ns.result_dir else name


def _write_json(path: str, record: dict) -> None:
    try:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError as err:
        raise BenchmarkError(f"cannot write the result to {path}: {err}", 2) from None
