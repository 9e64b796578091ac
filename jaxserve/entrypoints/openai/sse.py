"""Server-sent events: how a streamed completion or chat answer goes over the wire.

Where it sits: the last step of a streaming request. The completion and chat handlers turn
engine outputs into chunk dicts; this writes each one as a `data: ...` event and ends with
`data: [DONE]`, as OpenAI's clients expect. It is shared so that both endpoints frame
events, report a late engine failure and finish the stream the same way.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from aiohttp import web

from jaxserve.engine.async_engine import EngineRequestError
from jaxserve.entrypoints.openai.protocol import error_body


async def sse_response(
    raw: web.Request, chunks: AsyncIterator[dict], named: bool = False, done: bool = True
) -> web.StreamResponse:
    """Stream `chunks` as server-sent events, then `data: [DONE]` (unless not `done`). An engine
    failure after the stream has started is sent as an error event (the status line is already
    out). `named`: each event also has an `event:` line, its chunk's "type" (the Responses API's)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(raw)
    async with contextlib.aclosing(chunks) as gen:
        try:
            async for chunk in gen:
                await _send(response, chunk, chunk["type"] if named else None)
        except EngineRequestError as e:
            await _send(
                response, {**error_body(str(e), 500), "type": "error"} if named else error_body(str(e), 500)
            )
    if done:
        await _send(response, "[DONE]")
    await response.write_eof()
    return response


async def _send(response: web.StreamResponse, data: dict | str, event: str | None = None) -> None:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    await response.write(f"{head}data: {payload}\n\n".encode())
