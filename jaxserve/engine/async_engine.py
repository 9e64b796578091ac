"""AsyncLLMEngine: the LLMEngine on its own thread, one asyncio stream per request.

Where it sits: between the HTTP handlers (asyncio) and LLMEngine (blocking, one step at a
time). The engine thread is the only one that touches the scheduler: handlers build a
request with LLMEngine.make_request() on the event loop (so a bad request fails there,
before anything is queued) and post it, or an abort, to the thread's inbox. After every
step the thread posts the outputs back to the event loop, where each lands in its
request's stream.

A stream never queues up behind a slow reader nor holds up the engine: it keeps the newest
cumulative output, or merges the deltas (output_kind DELTA) its reader has not taken yet.

With data parallelism (`-dp N`) there are N engines, each on its own device group and its
own thread; router.py picks the replica of each request when it is queued, and the metrics
see the replicas' scheduler stats summed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from jaxserve import beam_search as beams
from jaxserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from jaxserve.config import EngineConfig
from jaxserve.engine.input_processor import PromptType
from jaxserve.engine.llm_engine import EngineDeadError, LLMEngine
from jaxserve.engine.pacing import StepWatcher, take_turn
from jaxserve.engine.parent_request import ParentRequest
from jaxserve.engine.request_stream import RequestStream
from jaxserve.engine.router import Router
from jaxserve.engine.stats import IterationStats, SchedulerStats
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

StatsCallback = Callable[[SchedulerStats, IterationStats], None]


class EngineRequestError(RuntimeError):
    """The engine failed while running the request (not the client's fault)."""


@dataclass
class _Replica:
    """One engine, the thread that steps it and that thread's inbox."""

    index: int
    engine: LLMEngine
    inbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    wakeup: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    watcher: StepWatcher | None = None  # wakes the thread when a step ends on the device
    stats: SchedulerStats | None = None  # its last published snapshot


class AsyncLLMEngine:
    def __init__(
        self, engine: LLMEngine | Sequence[LLMEngine], stats_callbacks: tuple[StatsCallback, ...] = ()
    ):
        engines = [engine] if isinstance(engine, LLMEngine) else list(engine)
        self.replicas = [_Replica(i, e) for i, e in enumerate(engines)]
        self.engine = engines[0]  # config, tokenizer, request checks: the same in every replica
        for e in engines[1:]:  # one grammar cache: a schema checked by the server compiles once
            e.share_grammars(self.engine)
        self.stats_callbacks = list(stats_callbacks)
        self._streams: dict[str, RequestStream] = {}
        self._routes: dict[str, int] = {}  # request id -> its replica
        sched = self.engine.config.scheduler_config
        self.router = Router(
            len(engines),
            self.engine.config.cache_config.block_size,
            capacity_blocks=self.engine.num_kv_blocks,
            slack=max(1, sched.max_num_seqs // 4),
        )
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead_error: BaseException | None = None
        self._warned_trace_headers = False

    @classmethod
    def from_engine_args(cls, engine_args, stats_callbacks: tuple[StatsCallback, ...] = ()) -> AsyncLLMEngine:
        """One engine per data-parallel rank, each on its own tensor_parallel_size x
        pipeline_parallel_size devices."""
        import jax

        config = engine_args.create_engine_config()  # checks that tp x pp x dp devices are there
        pc = config.parallel_config
        size, dp = pc.tensor_parallel_size * pc.pipeline_parallel_size, pc.data_parallel_size
        devices = jax.devices()
        engines = []
        for rank in range(dp):
            group = devices[rank * size : (rank + 1) * size]
            if dp > 1:
                logger.info("Data-parallel rank %d of %d on devices %s", rank, dp, [d.id for d in group])
            # the first engine loads the tokenizer (beside its weights); the others share it
            engines.append(LLMEngine(config, engines[0].tokenizer if engines else None, devices=group))
        return cls(engines, stats_callbacks)

    # ---- life cycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine threads; call from the event loop that will read the streams."""
        if self.replicas[0].thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        for r in self.replicas:
            name = "jaxserve-engine" if len(self.replicas) == 1 else f"jaxserve-engine-{r.index}"
            r.watcher = StepWatcher(r.wakeup, name=name.replace("engine", "step-watcher"))
            r.thread = threading.Thread(target=self._run, args=(r,), name=name, daemon=True)
            r.thread.start()

    def shutdown(self) -> None:
        """Stop the threads after their current steps; requests still running are aborted."""
        for r in self.replicas:  # start-up compiles still under way end after their current bucket
            r.engine.stop_compiling()
        if self.replicas[0].thread is None:
            return
        self._stopping = True
        for r in self.replicas:
            r.wakeup.set()
        for r in self.replicas:
            r.thread.join()
            r.thread = None
            r.watcher.stop()
        for stream in self._streams.values():
            stream.fail(EngineRequestError("The server is shutting down."))
        self._streams.clear()

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and all(
            r.thread is not None and r.thread.is_alive() for r in self.replicas
        )

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def sampling_defaults(self) -> dict:
        """Sampling fields the model's generation config sets, for requests that leave them out."""
        return self.engine.sampling_defaults

    def check_prompt_token_ids(self, token_ids: Sequence[int]) -> None:
        """ValueError for ids outside the vocabulary (before a tokenizer is asked to decode them)."""
        self.engine.check_prompt_token_ids(token_ids)

    def expand_images(self, prompt: Mapping) -> dict:
        """A prompt with images as it will run: its placeholders expanded, its images processed
        (CPU work: call it off the event loop); ValueError on bad images."""
        return self.engine.expand_images(prompt)

    def check_lora(self, lora_request) -> None:
        """Read a LoRA adapter as a request naming it would (ValueError, one line, if it cannot
        be served; LookupError if LoRA is not enabled)."""
        self.engine.check_lora(lora_request)

    # ---- sleep mode (LLMEngine.sleep) ---------------------------------------------------------

    async def sleep(self, level: int = 1) -> None:
        """Free every replica's weights and KV cache on the devices between two steps; the
        requests running meanwhile wait, and so do new ones, until wake_up."""
        self._check_running()
        await self._on_every_replica(lambda engine: engine.sleep(level))

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._check_running()
        await self._on_every_replica(lambda engine: engine.wake_up(tags))

    def is_sleeping(self) -> bool:
        return any(r.engine.is_sleeping for r in self.replicas)

    async def reset_prefix_cache(self) -> bool:
        self._check_running()
        return all(await self._on_every_replica(lambda engine: engine.reset_prefix_cache()))

    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineRequestError(f"The engine is not running: {self.dead_error}")

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile a request's grammar (cached for when the request is made); ValueError naming
        what is wrong with it. Blocking: a server calls it off its event loop."""
        self.engine.check_structured_outputs(params)

    def close_workers(self) -> None:
        """Tell the other processes of a multi-process engine, if any, to stop with this one."""
        self.engine.close_workers()

    # ---- requests ------------------------------------------------------------------------

    def make_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request=None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> ParentRequest:
        """Check and build a request without queueing it; ValueError on bad input."""
        if self.dead_error is not None:
            raise EngineRequestError(f"The engine is not running: {self.dead_error}")
        self._check_id_free(request_id)
        if trace_headers and not self.engine.tracing and not self._warned_trace_headers:
            self._warned_trace_headers = True
            logger.warning("Requests carry trace context, but tracing is off (--otlp-traces-endpoint).")
        return self.engine.make_request(
            request_id, prompt, params, priority, lora_request=lora_request, trace_headers=trace_headers
        )

    async def stream(self, parent: ParentRequest) -> AsyncIterator[RequestOutput]:
        """Queue a request from make_request and yield its (cumulative) outputs until it
        finishes. Leaving the loop early (a disconnected client cancels its handler)
        aborts the request, which frees its KV pages on the engine's next turn."""
        request_id = parent.request_id
        self._check_id_free(request_id)
        stream = RequestStream(deltas=parent.reports_deltas)
        self._streams[request_id] = stream
        replica = self._routes[request_id] = self.router.assign(parent.prompt_token_ids)
        self._post(replica, ("add", parent))
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
            self._routes.pop(request_id, None)
            self.router.release(replica)
            if not finished:
                self._post(replica, ("abort", request_id))

    def _check_id_free(self, request_id: str) -> None:
        """On the event loop, which owns the table of streams: a request id is taken from stream()
        until its stream ends (the engine's thread learns of the end through the inbox, in order)."""
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")

    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        """make_request + stream: bad input raises here, before anything is queued."""
        return self.stream(self.make_request(prompt, params, request_id, priority, lora_request))

    def start_beam_search(self, prompt: PromptType, params: BeamSearchParams) -> BeamSearch:
        """Check and tokenize a beam search without running it; ValueError on bad input."""
        if self.dead_error is not None:
            raise EngineRequestError(f"The engine is not running: {self.dead_error}")
        return beams.start_search(self.engine, self.engine.tokenize_prompt(prompt)[1], params)

    async def beam_search(self, search: BeamSearch, request_id: str, lora_request=None) -> BeamSearchOutput:
        """Run a search from start_beam_search (with the LoRA adapter, if any): each round, one
        one-token request per live beam (ids `{request_id}-{round}-{beam}`); cancelling aborts
        the round in flight."""

        async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
            outputs = [output async for output in stream]
            return outputs[-1]

        step = beams.step_params(search.params)
        for round_ in itertools.count():
            if search.done:
                break
            rounds = [
                last(
                    self.generate(
                        beams.step_prompt(search, beam), step, f"{request_id}-{round_}-{i}", 0, lora_request
                    )
                )
                for i, beam in enumerate(search.running)
            ]
            outputs = await asyncio.gather(*rounds)
            search.advance([out.outputs[0].logprobs[0] for out in outputs])
        return beams.finish(search, self.engine.tokenizer)

    def abort(self, request_id: str) -> None:
        replica = self._routes.get(request_id)
        if replica is not None:
            self._post(replica, ("abort", request_id))

    def _post(self, replica: int, message: tuple) -> None:
        r = self.replicas[replica]
        r.inbox.put(message)
        r.wakeup.set()

    # ---- the engine thread ---------------------------------------------------------------

    def _drain_inbox(self, replica: _Replica) -> None:
        while True:
            try:
                kind, payload = replica.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":  # (one abandoned meanwhile has its "abort" behind it in the inbox)
                try:
                    replica.engine.enqueue(payload)
                except ValueError as e:  # its id is still in use on this engine: fail it alone
                    self._loop.call_soon_threadsafe(self._fail_one, payload.request_id, e)
            elif kind == "abort":
                replica.engine.abort_request(payload)
            else:  # "call": a function of the engine, between steps, and the future it answers
                self._call(replica, *payload)

    def _call(
        self, replica: _Replica, fn: Callable[[LLMEngine], object], done: concurrent.futures.Future
    ) -> None:
        try:
            result = fn(replica.engine)
        except Exception as e:
            done.set_exception(e)
            return
        if isinstance(result, list):  # outputs (of the step sleep() collected): to their streams
            stats = (replica.engine.scheduler_stats(), IterationStats())
            self._loop.call_soon_threadsafe(self._publish, replica, result, stats)
            result = None
        done.set_result(result)

    async def _on_every_replica(self, fn: Callable[[LLMEngine], object]) -> list:
        """Run fn(engine) on each replica's thread between two steps; their results."""
        futures = []
        for r in self.replicas:
            futures.append(concurrent.futures.Future())
            self._post(r.index, ("call", (fn, futures[-1])))
        return [await asyncio.wrap_future(f) for f in futures]

    def _run(self, replica: _Replica) -> None:
        engine = replica.engine
        try:
            while not self._stopping and self.dead_error is None:
                self._drain_inbox(replica)
                outputs, wait = take_turn(engine, replica.watcher)  # engine/pacing.py
                if outputs is not None:
                    stats = (engine.scheduler_stats(), engine.iteration_stats)
                    self._loop.call_soon_threadsafe(self._publish, replica, outputs, stats)
                elif wait is None and (pending := engine.flush_stats()) is not None:  # idle
                    self._loop.call_soon_threadsafe(
                        self._publish, replica, [], (engine.scheduler_stats(), pending)
                    )
                if wait != 0:
                    replica.wakeup.wait(wait)
                    replica.wakeup.clear()
        except BaseException as e:  # the engine cannot go on: fail everyone, /health says so
            if not isinstance(e, EngineDeadError):
                logger.exception("The engine loop died")
            else:
                logger.error("The engine loop died: %s", e)
            self.dead_error = e
            for other in self.replicas:  # the other replicas stop too: one server, one fate
                other.wakeup.set()
            self._loop.call_soon_threadsafe(self._fail_all, e)
        finally:
            if self._stopping:
                engine.abort_all()
                engine.settle()  # asynchronous scheduling leaves the step after the last in flight
            self._refuse_calls(replica)

    def _refuse_calls(self, replica: _Replica) -> None:
        """Answer the calls left in a stopped thread's inbox (their callers would wait forever)."""
        while True:
            try:
                kind, payload = replica.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                payload[1].set_exception(EngineRequestError("The engine is not running."))

    def _publish(
        self, replica: _Replica, outputs: list[RequestOutput], stats: tuple[SchedulerStats, IterationStats]
    ) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
        replica.stats = stats[0]
        self.router.kv_usage[replica.index] = stats[0].kv_cache_usage
        sched = (
            stats[0] if len(self.replicas) == 1 else _sum_stats([r.stats for r in self.replicas if r.stats])
        )
        for callback in self.stats_callbacks:
            try:
                callback(sched, stats[1])
            except Exception:  # metrics must never take the server down
                logger.exception("A stats callback failed")

    def _fail_one(self, request_id: str, error: ValueError) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail(error)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(EngineRequestError(f"The engine stopped: {error}"))


def _sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """All replicas as one engine: counts and counters add up, KV usage is the mean."""
    return SchedulerStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        running_lora_adapters=tuple(dict.fromkeys(n for s in stats for n in s.running_lora_adapters)),
        waiting_lora_adapters=tuple(dict.fromkeys(n for s in stats for n in s.waiting_lora_adapters)),
    )
