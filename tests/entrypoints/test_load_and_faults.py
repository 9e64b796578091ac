"""The server under load and under misbehaving clients, on loopback over the tiny engine (a pool
of 63 pages of 8 tokens, 8 sequences a step):

- overload: 300 concurrent requests, far more than fit, all complete with the tokens they get
  alone (the waiting queue is unbounded, as vLLM's is), and the metrics return to idle;
- a disconnect storm: 200 streams dropped after their first chunk leave no request and no page;
- slow clients trickling their headers do not stop /health from answering; oversized header
  lines get a 4xx.
"""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
from server_inputs import MAX_TOKENS, PROMPTS

from jaxserve.entrypoints.openai.api_server import MAX_HEADER_LINE_BYTES


def metric(text: str, name: str) -> float:
    values = re.findall(rf"^jaxserve:{name}{{[^}}]*}} (\S+)$", text, re.M)
    assert values, name
    return sum(float(v) for v in values)


async def test_300_concurrent_requests_all_complete_and_the_server_returns_to_idle(
    server, llm_engine, reference
):
    url = str(server.make_url("/"))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> str:
            prompt = PROMPTS[i % len(PROMPTS)]
            body = {"prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": i % 2 == 0}
            async with session.post(url + "v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                if not body["stream"]:
                    return prompt, (await r.json())["choices"][0]["text"]
                text = ""
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        text += __import__("json").loads(line[6:])["choices"][0]["text"]
                return prompt, text

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(300))), timeout=600)
        assert all(text == reference[prompt][0] for prompt, text in results)
        async with session.get(url + "metrics") as r:
            text = await r.text()
    assert metric(text, "num_requests_running") == 0 and metric(text, "num_requests_waiting") == 0
    bm = llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


async def test_a_storm_of_200_dropped_streams_frees_every_page_at_once(server, llm_engine):
    url = str(server.make_url("/"))
    bm = llm_engine.scheduler.block_manager
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def drop_after_first_chunk(i: int) -> None:
            body = {"prompt": PROMPTS[i % 32], "max_tokens": 200, "ignore_eos": True, "stream": True}
            response = await session.post(url + "v1/completions", json=body)
            await response.content.readuntil(b"\n\n")
            response.close()

        await asyncio.wait_for(asyncio.gather(*(drop_after_first_chunk(i) for i in range(200))), timeout=600)
        dropped = time.monotonic()
        while llm_engine.has_unfinished_requests() or bm.num_free_blocks != bm.num_usable_blocks:
            assert time.monotonic() - dropped < 2.0, "pages still held after the storm"
            await asyncio.sleep(0.01)
        async with session.get(url + "metrics") as r:
            assert metric(await r.text(), "num_requests_running") == 0


async def test_slow_clients_do_not_hold_up_health_and_huge_headers_are_refused(server):
    host, port = server.host, server.port
    writers = []
    for _ in range(50):  # each sends half a request line and then a byte at a time
        _, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        await writer.drain()
        writers.append(writer)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(5):
                for w in writers:
                    w.write(b"T")
                start = time.monotonic()
                async with session.get(server.make_url("/health")) as r:
                    assert r.status == 200
                assert time.monotonic() - start < 1.0
                await asyncio.sleep(0.1)
            big = {"X-Big": "a" * (MAX_HEADER_LINE_BYTES + 1)}
            async with session.get(server.make_url("/health"), headers=big) as r:
                assert 400 <= r.status < 500
            async with session.get(server.make_url("/health")) as r:
                assert r.status == 200
    finally:
        for w in writers:
            w.close()
