"""One stream of engine outputs out of several, for a request with several prompts.

Where it sits: between the engine and the completion and chat handlers, inside
OpenAIServing.generate_all. A completions request may carry many prompts (and each may
run a beam search); the handler reads them as one stream so that it can answer each
prompt's outputs as they come, and so that a client who goes away (which closes that one
stream) aborts every prompt of the request instead of leaving some running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from jaxserve.outputs import RequestOutput


async def merge_streams(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Items of several streams as they come, tagged with the stream's index; closing the
    merged stream closes (and so aborts) every one of them."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(gen) as g:
                async for out in g:
                    queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the reader below
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
