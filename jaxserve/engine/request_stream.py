"""RequestStream: where one request's outputs wait for the handler that reads them.

Where it sits: AsyncLLMEngine puts each step's output of a request here, on the event loop; the
handler streaming that request takes them. It never queues up behind a slow reader nor holds up
the engine: it keeps the newest cumulative output, or merges the deltas (output_kind DELTA) the
reader has not taken yet, so a reader that falls behind gets one output with all of them.
"""

from __future__ import annotations

import asyncio

from jaxserve.outputs import RequestOutput


class RequestStream:
    """The newest output of one request (its deltas merged), or the error that ended it."""

    def __init__(self, deltas: bool = False) -> None:
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._deltas = deltas

    def put(self, output: RequestOutput) -> None:
        if self._deltas and self._latest is not None and output.error is None:
            self._latest.add(output)
        else:
            self._latest = output
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            raise self._error
        output, self._latest = self._latest, None
        return output
