"""A long mixed load against `jaxserve serve`: does anything leak or fail over time?

Why it exists: the unit and fault tests are short; a server runs for weeks. This starts the real
command line (default model unless --serve-args says otherwise), then keeps --concurrency clients
busy for --minutes with a mix of what clients do: plain and streamed completions and chats, n > 1,
logprobs, stop strings, and clients that drop a stream after its first chunk. Every minute it
records requests served, errors (any 5xx, any unexpected status or malformed answer), the server's
resident memory and its KV-cache usage; at the end, with no client left, the KV usage must be 0.

    python benchmarks/soak.py --minutes 10 --concurrency 32

Goal: zero errors, RSS flat after a warm-up of --warmup minutes (at most 5% growth; the
remaining step shapes compile in the background during the first ones), KV usage back to 0.
Writes benchmarks/results/soak_cpu_smollm2.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time

import aiohttp
from startup import wait_healthy  # benchmarks/startup.py, beside this file

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
WORDS = "the quick brown fox jumps over a lazy dog while Paris sleeps and JAX compiles".split()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^jaxserve:{name}{{[^}}]*}} (\S+)$", text, re.M))


def request_for(kind: str, rng: random.Random) -> tuple[str, dict]:
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(4, 40)))
    tokens = rng.randint(4, 24)
    if kind.startswith("chat"):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": prompt, "max_tokens": tokens}
        path = "/v1/completions"
    body["stream"] = kind.endswith("stream") or kind == "abort"
    if kind == "n":
        body.update(n=3, temperature=0.8, seed=rng.randint(0, 1000))
    elif kind == "logprobs":
        body.update(logprobs=True, top_logprobs=3) if "messages" in body else body.update(logprobs=3)
    elif kind == "stop":
        body.update(stop=[rng.choice(WORDS)], temperature=0.7)
    return path, body


KINDS = ["completion", "completion-stream", "chat", "chat-stream", "n", "logprobs", "stop", "abort"]


async def client(session, base: str, deadline: float, rng: random.Random, tally: dict) -> None:
    while time.monotonic() < deadline:
        kind = rng.choice(KINDS)
        path, body = request_for(kind, rng)
        try:
            async with session.post(base + path, json=body, timeout=aiohttp.ClientTimeout(total=300)) as r:
                if r.status != 200:
                    tally["errors"].append(f"{kind}: HTTP {r.status} {(await r.text())[:200]}")
                    continue
                if kind == "abort":
                    await r.content.readuntil(b"\n\n")
                    r.close()
                    tally["aborted"] += 1
                    continue
                if body["stream"]:
                    text = await r.text()
                    if not text.endswith("data: [DONE]\n\n") or '"error"' in text:
                        tally["errors"].append(f"{kind}: bad stream end {text[-200:]!r}")
                        continue
                else:
                    out = await r.json()
                    if len(out["choices"]) != body.get("n", 1):
                        tally["errors"].append(f"{kind}: {len(out['choices'])} choices")
                        continue
            tally["served"] += 1
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            tally["errors"].append(f"{kind}: {type(e).__name__}: {e}")


async def soak(base: str, pid: int, minutes: float, concurrency: int, seed: int) -> dict:
    tally = {"served": 0, "aborted": 0, "errors": []}
    timeline = []
    start = time.monotonic()
    deadline = start + minutes * 60
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def sample() -> None:
            async with session.get(base + "/metrics") as r:
                text = await r.text()
            timeline.append({
                "minute": round((time.monotonic() - start) / 60, 2), "served": tally["served"],
                "aborted": tally["aborted"], "errors": len(tally["errors"]), "rss_mib": round(rss_mib(pid), 1),
                "kv_usage": round(metric(text, "kv_cache_usage_perc"), 4),
                "running": metric(text, "num_requests_running"), "waiting": metric(text, "num_requests_waiting"),
            })  # fmt: skip
            print(json.dumps(timeline[-1]), flush=True)

        async def sampler() -> None:
            while time.monotonic() < deadline:
                await asyncio.sleep(60)
                await sample()

        clients = [
            client(session, base, deadline, random.Random(seed + i), tally) for i in range(concurrency)
        ]
        await asyncio.gather(sampler(), *clients)
        for _ in range(100):  # the last streams' aborts land
            await asyncio.sleep(0.1)
            async with session.get(base + "/metrics") as r:
                if metric(await r.text(), "kv_cache_usage_perc") == 0:
                    break
        await sample()
    return {
        "tally": {**tally, "errors": tally["errors"][:50], "num_errors": len(tally["errors"])},
        "timeline": timeline,
    }


def summary(timeline: list[dict], warmup_minutes: float) -> dict:
    """RSS growth measured from the first sample after the warm-up (the background compile of
    the remaining step shapes adds its executables in the first minutes), and the final KV usage."""
    after = [t for t in timeline if t["minute"] >= warmup_minutes] or timeline
    base = after[0]["rss_mib"]
    return {
        "rss_after_warmup_mib": base,
        "rss_at_end_mib": timeline[-1]["rss_mib"],
        "rss_growth_after_warmup": round(max(t["rss_mib"] for t in after) / base - 1, 4),
        "kv_usage_at_end": timeline[-1]["kv_usage"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--serve-args", default="", help="Extra `jaxserve serve` flags.")
    p.add_argument("--port", type=int, default=8911)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float, default=2.0, help="Minutes before RSS growth is counted.")
    p.add_argument("--output", default=os.path.join(RESULTS, "soak_cpu_smollm2.json"))
    args = p.parse_args()
    log = tempfile.NamedTemporaryFile("w+", prefix="jaxserve-soak-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(args.port), "--disable-log-requests",
           *shlex.split(args.serve_args)]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(base + "/health", server, time.perf_counter() + 900)
        result = asyncio.run(soak(base, server.pid, args.minutes, args.concurrency, args.seed))
    finally:
        server.terminate()
        server.wait(60)
    result.update(
        command=cmd[2:], config=vars(args), server_log=log.name, **summary(result["timeline"], args.warmup)
    )
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    t = result["tally"]
    print(f"served {t['served']}, aborted {t['aborted']}, errors {t['num_errors']}, RSS after warm-up "
          f"{result['rss_after_warmup_mib']:.0f} -> {result['rss_at_end_mib']:.0f} MiB (most "
          f"{result['rss_growth_after_warmup']:.1%} above), KV usage at the end {result['kv_usage_at_end']}; "
          f"wrote {args.output}")  # fmt: skip
    return 0 if t["num_errors"] == 0 and result["kv_usage_at_end"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
