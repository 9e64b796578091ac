"""The server as users start it: a separate process from vLLM's module path, healthy after
start-up, and on SIGTERM it lets a running stream finish and exits 0. With -dp 2 -tp 2 -pp 2 on 8
(fake CPU) devices it answers concurrent requests as a single engine would."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from tiny_models import TEST_XLA_CACHE, TEST_XLA_FLAGS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_pair() -> int:
    """A port p with p + 1 free too (the processes' coordinator and process 0's presence port)."""
    while True:
        port = _free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def _start(model: str, log_path, *flags: str, devices: int = 1):
    port = _free_port()
    # fmt: off
    cmd = [
        sys.executable, "-m", "jaxserve.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--num-gpu-blocks-override", "64",
        "--block-size", "8", "--enforce-eager", "--no-use-tqdm-on-load",
        "--compilation-config", json.dumps({"cache_dir": TEST_XLA_CACHE}),
        *flags,
    ]
    # fmt: on
    log = open(log_path, "w+")
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}",
        "VLLM_SERVER_DEV_MODE": "1",  # /sleep and /wake_up (with --enable-sleep-mode)
    }
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}/", log


def _stop(proc, log) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


async def _wait_healthy(proc, url: str, log, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"server exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                async with session.get(url + "health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.5)
    raise AssertionError("server did not become healthy")


async def test_sigterm_drains_running_requests_and_exits_0(tiny_llama_gqa, tmp_path):
    """40 streams in flight (8 running, the rest waiting): on SIGTERM every one still ends with a
    finish_reason, new connections are refused, and the process exits 0 within the drain time."""
    # 256 pages of 8 tokens: 8 running sequences of 45 tokens fit without preemption.
    proc, url, log = _start(tiny_llama_gqa[0], tmp_path / "server.log", "--num-gpu-blocks-override", "256")
    try:
        await _wait_healthy(proc, url, log)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            started = asyncio.Event()

            async def stream(max_tokens: int) -> list[dict]:
                body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": max_tokens,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                async with session.post(url + "v1/completions", json=body) as r:
                    assert r.status == 200
                    text = ""
                    async for chunk in r.content.iter_any():
                        text += chunk.decode()
                        started.set()
                assert text.endswith("data: [DONE]\n\n")
                return [json.loads(f[6:]) for f in text.split("\n\n") if f and f != "data: [DONE]"]

            # A first round of the same lengths compiles every step shape this load needs
            # (--enforce-eager compiles on demand, and the compiles of longer contexts, left to the
            # drain, once held it for 20 s on a cold cache and a busy machine).
            await asyncio.wait_for(asyncio.gather(*(stream(40) for _ in range(20))), 120)
            started.clear()
            # 200 decode steps (five rounds of 8): long enough that even a server whose host work
            # hides behind the device takes the signal mid-drain, short enough that a 2-core
            # machine running other tests beside the server (600 and 400 steps have taken 30 s
            # there) still drains well within the 30 s
            streams = [asyncio.ensure_future(stream(40)) for _ in range(40)]
            await asyncio.wait_for(started.wait(), 60)
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            running = [s for s in streams if not s.done()]
            assert running  # the signal came mid-load; each of these must still end well
            refused = False  # new connections stop being taken soon after the signal ...
            # (a probe that connected as the socket closed gets no answer: it gives up after 1 s
            # and probes again, rather than hold a connection the shutdown would wait 30 s for)
            probe = aiohttp.ClientTimeout(total=1)
            while not refused and time.monotonic() - signalled < 10:
                try:
                    async with aiohttp.ClientSession(timeout=probe) as other:
                        await other.get(url + "health")
                    await asyncio.sleep(0.02)
                except TimeoutError:  # (first: aiohttp's read timeout is a connection error too)
                    pass
                except aiohttp.ClientConnectionError:
                    refused = True
            assert refused
            results = await asyncio.wait_for(asyncio.gather(*streams), 60)
            drained = time.monotonic() - signalled
        assert all(events[-1]["choices"][0]["finish_reason"] == "length" for events in results)
        assert proc.wait(timeout=60) == 0
        log.seek(0)
        server_log = "\n".join(line for line in log.read().splitlines() if "aiohttp.access" not in line)
        took = f"streams done {drained:.1f} s after the signal; the server's log:\n{server_log[-3000:]}"
        assert time.monotonic() - signalled < 30, took  # the drain time (SHUTDOWN_TIMEOUT_S)
    finally:
        _stop(proc, log)


# A constraint on half of the served prompts: the mask travels to every replica and process.
GUIDED = {"guided_regex": "[a-z]{2,6}( [a-z]{2,6}){1,8}"}


def _offline_texts(model: str, prompts: list[list[int]]) -> list[str]:
    """12 greedy tokens per prompt from one engine in this process (one CPU device); the odd
    prompts under GUIDED."""
    from tiny_models import engine_kwargs

    from jaxserve import LLM, SamplingParams
    from jaxserve.sampling_params import StructuredOutputsParams

    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    guided = plain.clone(structured_outputs=StructuredOutputsParams(regex=GUIDED["guided_regex"]))
    outs = LLM(model, **engine_kwargs()).generate(
        [{"prompt_token_ids": p} for p in prompts],
        [guided if i % 2 else plain for i in range(len(prompts))],
        use_tqdm=False,
    )
    return [o.outputs[0].text for o in outs]


async def _served_texts(url: str, prompts: list[list[int]]) -> list[str]:
    """The same, asked of a server all at once."""

    async def one(session, i, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        body.update(GUIDED if i % 2 else {})
        async with session.post(url + "v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["choices"][0]["text"]

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, i, p) for i, p in enumerate(prompts))))


async def _sleep_and_wake(url: str, level: int) -> None:
    async with aiohttp.ClientSession() as session:
        for path in (f"sleep?level={level}", "wake_up"):
            async with session.post(url + path) as r:
                assert r.status == 200, await r.text()


async def test_two_replicas_of_two_stages_of_two_devices_answer_like_one_engine(tiny_llama_gqa, tmp_path):
    prompts = [[5 + i, 17, 300, 42 + i, 9] * (1 + i % 3) for i in range(8)]
    single = _offline_texts(tiny_llama_gqa[0], prompts)
    flags = ("-dp", "2", "-tp", "2", "-pp", "2", "--enable-sleep-mode")
    proc, url, log = _start(tiny_llama_gqa[0], tmp_path / "dp.log", *flags, devices=8)
    try:
        await _wait_healthy(proc, url, log)
        assert await _served_texts(url, prompts) == single
        await _sleep_and_wake(url, 2)  # every replica sleeps, reads its weights again, wakes
        assert await _served_texts(url, prompts) == single
        log.seek(0)
        started = log.read()
        assert "Data-parallel rank 1 of 2 on devices [4, 5, 6, 7]" in started, started[-2000:]
    finally:
        _stop(proc, log)


# ---- several processes: one model over 2 x 4 fake CPU devices (jax.distributed, gloo) ----------


@pytest.fixture(scope="module")
def tp_llama(tmp_path_factory):
    from tiny_models import TP_LLAMA, make_checkpoint

    path = str(tmp_path_factory.mktemp("tp-llama-mh"))
    make_checkpoint(path, "LlamaConfig", "LlamaForCausalLM", TP_LLAMA, "float32", 0)
    return path


def _multihost(model, tmp_path, processes=(0, 1), num_processes=2, timeout="60", parallel=("-tp", "8")):
    port = str(_free_port_pair())
    started = {}
    for rank in processes:
        flags = (*parallel, "--distributed-executor-backend", "jax", "--data-parallel-address", "127.0.0.1",
                 "--data-parallel-rpc-port", port, "--num-processes", str(num_processes),
                 "--process-id", str(rank), "--distributed-timeout", timeout, "--enable-sleep-mode",
                 "--compilation-config", '{"cache_dir": ""}')  # fmt: skip
        started[rank] = _start(model, tmp_path / f"p{rank}.log", *flags, devices=4)
    return started


async def test_two_processes_serve_one_model_like_one_process(tp_llama, tmp_path):
    prompts = [[5 + i, 17, 300, 42 + i, 9] * (1 + i % 3) for i in range(4)]
    single = _offline_texts(tp_llama, prompts)
    started = _multihost(tp_llama, tmp_path)
    (p0, url, log0), (p1, _, _) = started[0], started[1]
    try:
        await _wait_healthy(p0, url, log0)
        assert await _served_texts(url, prompts) == single
        await _sleep_and_wake(url, 1)  # each process frees and restores its own shards
        assert await _served_texts(url, prompts) == single

        # the second process dies: the first says so and exits, instead of hanging
        p1.kill()
        p1.wait()
        start = time.monotonic()
        assert p0.wait(timeout=60) == 1
        assert time.monotonic() - start < 30
        log0.seek(0)
        assert "jaxserve: error: process 1 stopped" in log0.read()
    finally:
        for proc, _, log in started.values():
            _stop(proc, log)


async def test_two_processes_serve_pipeline_stages_like_one_process(tp_llama, tmp_path):
    """-pp 2 -tp 4 over two processes of 4 devices: each process holds one stage's layers."""
    prompts = [[5 + i, 17, 300, 42 + i, 9] * (1 + i % 3) for i in range(4)]
    single = _offline_texts(tp_llama, prompts)
    started = _multihost(tp_llama, tmp_path, parallel=("-tp", "4", "-pp", "2"))
    try:
        (p0, url, log0) = started[0]
        await _wait_healthy(p0, url, log0)
        assert await _served_texts(url, prompts) == single
    finally:
        for proc, _, log in started.values():
            _stop(proc, log)


def test_a_process_that_never_arrives_is_named(tp_llama, tmp_path):
    started = _multihost(tp_llama, tmp_path, processes=(0,), num_processes=3, timeout="3")
    proc, _, log = started[0]
    try:
        assert proc.wait(timeout=60) == 1
        log.seek(0)
        text = log.read()
        lines = [line for line in text.splitlines() if line.startswith("jaxserve: error:")]
        assert len(lines) == 1 and "Process(es) [1, 2] of 3 never arrived within 3 s" in lines[0], text[
            -3000:
        ]
    finally:
        _stop(proc, log)


def test_a_taken_presence_port_is_a_named_error():
    from jaxserve import distributed

    port = _free_port_pair()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        with pytest.raises(
            distributed.DistributedError, match=rf"cannot listen on 127.0.0.1:{port + 1} .*{port}\)"
        ):
            distributed._Presence("127.0.0.1", port + 1, 2, 0, 1.0)
