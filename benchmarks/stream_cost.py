"""What one streamed token costs the server's host, for a short and a long stream.

A 2-layer, 64-wide Llama with dummy weights and the default model's tokenizer serves streamed
requests (temperature 1, `ignore_eos`) through the real HTTP server, which runs on its own
thread and event loop; the client reads the stream from the main thread. Measured, per streamed
token, what the host spends on the stream itself:

- loop: the CPU time of the server's event loop thread (reading the engine's outputs, building,
  encoding and sending the chunks);
- outputs: the engine thread's time in the OutputProcessor (detokenizing, building the step's
  RequestOutputs), timed around its two calls;
- stream = loop + outputs. Scheduling, the step's inputs and the step itself are left out: they
  cost the same per token at any output length (but for the attention over a longer context).

A stream whose every step rebuilds the whole output so far costs the host more per token the
longer it gets; the ratio `long / short` says by how much (1.0: not at all).

    python benchmarks/stream_cost.py [--short 256] [--long 4096] [--rounds 3] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
# endpoint, body fields
CASES = {
    "completions": ("/v1/completions", {"prompt": "Once upon a time"}),
    "completions+logprobs": ("/v1/completions", {"prompt": "Once upon a time", "logprobs": 5}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}]}),
    "chat+logprobs": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Tell me a story."}], "logprobs": True, "top_logprobs": 5},
    ),
}


class Server:
    """The jaxserve HTTP server on a thread of its own, with its own event loop."""

    def __init__(self, model_dir: str, max_len: int):
        from jaxserve.args import EngineArgs
        from jaxserve.engine.async_engine import AsyncLLMEngine
        from jaxserve.engine.llm_engine import LLMEngine
        from jaxserve.entrypoints.openai.api_server import HANDLER_SETTINGS, build_app
        from jaxserve.entrypoints.openai.server_args import ServerArgs
        from jaxserve.loader.default_model import default_model_path

        args = EngineArgs(
            model=model_dir,
            tokenizer=default_model_path(),
            load_format="dummy",
            served_model_name=["m"],
            max_model_len=max_len,
            max_num_seqs=4,
            max_num_batched_tokens=256,
            num_gpu_blocks_override=max_len // 16 + 8,
            block_size=16,
            use_tqdm_on_load=False,
            enforce_eager=True,  # each shape compiled by the warm-up stream of its case
            compilation_config={"cache_dir": ""},
        )
        self.engine = AsyncLLMEngine(LLMEngine.from_engine_args(args))
        self.app = build_app(self.engine, ServerArgs(disable_log_stats=True))
        self.settings = HANDLER_SETTINGS
        self.loop = asyncio.new_event_loop()
        self.url: str | None = None
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), name="server-loop", daemon=True)
        self.thread.start()
        started.wait()

    def _serve(self, started: threading.Event) -> None:
        from aiohttp.test_utils import TestServer

        asyncio.set_event_loop(self.loop)
        self.server = TestServer(self.app, host="127.0.0.1", **self.settings)
        self.loop.run_until_complete(self.server.start_server())
        self.url = str(self.server.make_url("")).rstrip("/")
        started.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()

    def loop_cpu_seconds(self) -> float:
        """CPU time so far of the server's event loop thread."""
        return time.clock_gettime(time.pthread_getcpuclockid(self.thread.ident))


class Timed:
    """Wraps `owner.name`, adding up the wall time of its calls (made on one thread)."""

    def __init__(self, owner, name: str):
        self.inner, self.total = getattr(owner, name), 0.0
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - start


async def _stream(
    session, server: Server, timers: list[Timed], case: str, tokens: int
) -> tuple[float, float]:
    """(loop CPU seconds, output-building seconds) of one streamed request of `tokens` tokens."""
    path, fields = CASES[case]
    body = {"model": "m", "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0, "seed": 7,
            "stream": True, "stream_options": {"include_usage": True}, **fields}  # fmt: skip
    usage = None
    cpu0, out0 = server.loop_cpu_seconds(), sum(t.total for t in timers)
    async with session.post(server.url + path, json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {") and b'"usage": {' in line:
                usage = json.loads(line[6:]).get("usage") or usage
    cpu, outputs = server.loop_cpu_seconds() - cpu0, sum(t.total for t in timers) - out0
    assert usage and usage["completion_tokens"] == tokens, usage
    return cpu, outputs


async def _measure(server: Server, short: int, long: int, rounds: int) -> dict:
    import aiohttp

    processor = server.engine.engine.output_processor
    timers = [Timed(processor, "detokenize"), Timed(processor, "make_outputs")]
    results = {}
    async with aiohttp.ClientSession() as session:
        for case in CASES:
            await _stream(session, server, timers, case, 32)  # warm-up: every step shape compiled
            runs: dict[int, list[tuple[float, float]]] = {short: [], long: []}
            for _ in range(rounds):  # alternating, so that a noisy machine weighs on both alike
                for n in (short, long):
                    loop, outputs = await _stream(session, server, timers, case, n)
                    runs[n].append((1e6 * loop / n, 1e6 * outputs / n))
            med = {
                n: {
                    "loop": statistics.median(r[0] for r in v),
                    "outputs": statistics.median(r[1] for r in v),
                    "stream": statistics.median(r[0] + r[1] for r in v),
                }
                for n, v in runs.items()
            }
            ratio = med[long]["stream"] / med[short]["stream"]
            results[case] = {"us_per_token": {str(n): m for n, m in med.items()}, "long_over_short": ratio}
            print(
                f"{case:22s} stream host us/token: {short} tokens {med[short]['stream']:6.1f} (loop "
                f"{med[short]['loop']:6.1f}, outputs {med[short]['outputs']:5.1f}); {long} tokens "
                f"{med[long]['stream']:6.1f} (loop {med[long]['loop']:6.1f}, outputs {med[long]['outputs']:5.1f}); "
                f"long/short {ratio:.2f}",
                flush=True,
            )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/stream_cost.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", type=int, default=256)
    parser.add_argument("--long", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    max_len = ns.long + 64
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as fh:
            json.dump({**TINY, "vocab_size": 49152, "max_position_embeddings": max_len}, fh)
        server = Server(model_dir, max_len)
        try:
            results = asyncio.run(_measure(server, ns.short, ns.long, ns.rounds))
        finally:
            server.close()
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            json.dump({"config": {**vars(ns), "cpu_count": os.cpu_count()}, "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
