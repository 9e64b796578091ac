"""The serving benchmark's HTTP client: one streaming request per prompt, timed chunk by chunk.

Where it sits: between the prompts (``dataset``) and the numbers (``metrics``). It speaks the
OpenAI API over HTTP, so it times what any client of the server would see and works against
jaxserve and vLLM alike. The backend names vLLM's client flavours: completions (``openai``,
``vllm``) or chat completions (``openai-chat``), which differ only in the request body and in
where a stream chunk keeps its text.

Timings: TTFT is the arrival of the first chunk that carries text (a chat stream's empty role
chunk does not count), ITL the gaps between later text chunks, latency the end of the stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

from jaxserve.benchmarks.benchmark_error import BenchmarkError
from jaxserve.benchmarks.dataset import SampleRequest

# Default endpoint per backend; "vllm" is vLLM's own name for its completions client.
BACKEND_ENDPOINTS = {
    "openai": "/v1/completions",
    "vllm": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
# A long benchmark at a low rate can keep a request queued for a long time; only a hung server
# should trip this.
_REQUEST_TIMEOUT_S = 6 * 60 * 60


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
