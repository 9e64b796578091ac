"""AsyncLLMEngine: the LLMEngine on its own thread, one asyncio stream per request.

Where it sits: between the HTTP handlers (asyncio) and LLMEngine (blocking, one step at a
time). The engine thread is the only one that touches the scheduler: handlers build a
request with LLMEngine.make_request() on the event loop (so a bad request fails there,
before anything is queued) and post it, or an abort, to the thread's inbox. After every
step the thread posts the outputs back to the event loop, where each lands in its
request's stream.

A stream keeps only the newest output: outputs are cumulative, so a slow reader skips
intermediate ones instead of queueing them, and never holds up the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from jaxserve.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    finish,
    start_search,
    step_params,
)
from jaxserve.engine.llm_engine import EngineDeadError, LLMEngine, ParentRequest, PromptType
from jaxserve.engine.stats import IterationStats, SchedulerStats
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

StatsCallback = Callable[[SchedulerStats, IterationStats], None]


class EngineRequestError(RuntimeError):
    """The engine failed while running the request (not the client's fault)."""


class _RequestStream:
    """The newest output of one request, or the error that ended it."""

    def __init__(self) -> None:
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
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


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, stats_callbacks: tuple[StatsCallback, ...] = ()):
        self.engine = engine
        self.stats_callbacks = list(stats_callbacks)
        self._streams: dict[str, _RequestStream] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead_error: BaseException | None = None

    # ---- life cycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the thread after its current step; requests still running are aborted."""
        if self._thread is None:
            return
        self._stopping = True
        self._wakeup.set()
        self._thread.join()
        self._thread = None
        for stream in self._streams.values():
            stream.fail(EngineRequestError("The server is shutting down."))
        self._streams.clear()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    # ---- requests ------------------------------------------------------------------------

    def make_request(
        self, prompt: PromptType, params: SamplingParams, request_id: str, priority: int = 0
    ) -> ParentRequest:
        """Check and build a request without queueing it; ValueError on bad input."""
        if self.dead_error is not None:
            raise EngineRequestError(f"The engine is not running: {self.dead_error}")
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        return self.engine.make_request(request_id, prompt, params, priority)

    async def stream(self, parent: ParentRequest) -> AsyncIterator[RequestOutput]:
        """Queue a request from make_request and yield its (cumulative) outputs until it
        finishes. Leaving the loop early (a disconnected client cancels its handler)
        aborts the request, which frees its KV pages on the engine's next turn."""
        request_id = parent.request_id
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        stream = _RequestStream()
        self._streams[request_id] = stream
        self._post(("add", parent))
        finished = False
        try:
            while not finished:
                output = await stream.get()
                if output.error is not None:
                    raise EngineRequestError(output.error)
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(("abort", request_id))

    def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """make_request + stream: bad input raises here, before anything is queued."""
        return self.stream(self.make_request(prompt, params, request_id, priority))

    def start_beam_search(self, prompt: PromptType, params: BeamSearchParams) -> BeamSearch:
        """Check and tokenize a beam search without running it; ValueError on bad input."""
        if self.dead_error is not None:
            raise EngineRequestError(f"The engine is not running: {self.dead_error}")
        return start_search(self.engine, self.engine.tokenize_prompt(prompt)[1], params)

    async def beam_search(self, search: BeamSearch, request_id: str) -> BeamSearchOutput:
        """Run a search from start_beam_search: each round, one one-token request per live
        beam (ids `{request_id}-{round}-{beam}`); cancelling aborts the round in flight."""

        async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
            outputs = [output async for output in stream]
            return outputs[-1]

        step = step_params(search.params)
        for round_ in itertools.count():
            if search.done:
                break
            rounds = [
                last(self.generate({"prompt_token_ids": beam.tokens}, step, f"{request_id}-{round_}-{i}"))
                for i, beam in enumerate(search.running)
            ]
            outputs = await asyncio.gather(*rounds)
            search.advance([out.outputs[0].logprobs[0] for out in outputs])
        return finish(search, self.engine.tokenizer)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def _post(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    # ---- the engine thread ---------------------------------------------------------------

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                if payload.request_id in self._streams:  # not abandoned while in the inbox
                    self.engine.enqueue(payload)
            else:
                self.engine.abort_request(payload)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_inbox()
                if not engine.has_unfinished_requests():
                    pending = engine.flush_stats()
                    if pending is not None:
                        self._loop.call_soon_threadsafe(
                            self._publish, [], (engine.scheduler_stats(), pending)
                        )
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                outputs = engine.step()
                stats = (engine.scheduler_stats(), engine.iteration_stats)
                self._loop.call_soon_threadsafe(self._publish, outputs, stats)
        except BaseException as e:  # the engine cannot go on: fail everyone, /health says so
            if not isinstance(e, EngineDeadError):
                logger.exception("The engine loop died")
            else:
                logger.error("The engine loop died: %s", e)
            self.dead_error = e
            self._loop.call_soon_threadsafe(self._fail_all, e)
        finally:
            if self._stopping:
                engine.abort_all()

    def _publish(self, outputs: list[RequestOutput], stats: tuple[SchedulerStats, IterationStats]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
        for callback in self.stats_callbacks:
            try:
                callback(*stats)
            except Exception:  # metrics must never take the server down
                logger.exception("A stats callback failed")

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(EngineRequestError(f"The engine stopped: {error}"))
