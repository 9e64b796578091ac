"""LLMEngine: the heart of jaxserve. One step() is the whole request path:

    schedule -> runner.dispatch -> runner.collect -> scheduler.update -> detokenize (stop strings)
    -> outputs

(runner.dispatch fills the structured-output rows' token masks, through structured_output, while
the device runs the forward pass.)

With asynchronous scheduling (the default) a step schedules and dispatches step N+1 before it
collects step N, so the device runs step N+1 while the host updates requests, detokenizes and
builds outputs for step N: the host never leaves the device waiting. Requests whose next step
depends on the tokens just sampled (structured outputs, bad words, proposals) make it wait.

The InputProcessor checks and builds requests, the Scheduler owns them while they run, the
runner owns everything on the device, and the OutputProcessor turns their tokens into outputs.
A request with n > 1 runs as n child sequences that share the prompt (and, through the prefix
cache, its pages).

Adding a request is two halves so that a server can validate and tokenize on its own thread:
make_request() checks and builds (touching no queue), enqueue() hands the result to the
scheduler. A step whose device call fails fails only the requests in that step.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from jaxserve.config import EngineConfig
from jaxserve.engine.input_processor import InputProcessor, PromptType
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.pacing import StepPacer
from jaxserve.engine.parent_request import ParentRequest
from jaxserve.engine.request import RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.stats import IterationStats, SchedulerStats
from jaxserve.engine.swap_space import SwapSpace
from jaxserve.engine.tracing import RequestTracer
from jaxserve.loader.generation_config import read_generation_config, sampling_defaults
from jaxserve.loader.tokenizer import load_tokenizer
from jaxserve.lora.adapter import AdapterCache
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.runner import kv_scales
from jaxserve.runner.sleep import TAGS as SLEEP_TAGS
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler_output import SchedulerOutput, StepRunner
from jaxserve.spec_decode.draft_model import DraftModelProposer
from jaxserve.structured_output import bitmask_filler

logger = logging.getLogger(__name__)


class Dispatched(NamedTuple):
    """A step on the device whose results the engine has not collected yet."""

    sched: SchedulerOutput
    handle: Any  # the runner's, for is_ready / wait_ready / collect


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (its device state is lost)."""


def build_runner(config: EngineConfig, devices=None, step_cache=None):
    """The device side: a ModelRunner over a mesh of `devices` (default: the first
    tensor_parallel_size), keeping its compiled steps in `step_cache` (a runner.StepCache to
    share with other runners of the same model and shapes; None: its own)."""
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.sharding import mesh_for

    mesh = mesh_for(config.parallel_config, devices=devices)
    return ModelRunner(config, mesh, step_cache=step_cache)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer=None,
        devices=None,
        runner: StepRunner | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """runner: the device side (default: build_runner(config, devices), with the tokenizer
        loading beside it; a test passes a fake). clock: seconds on a monotonic clock, what
        requests' arrival and token times and the pacing of steps are measured on (a test
        passes one it advances itself)."""
        self.config = config
        self.clock = clock
        if tokenizer is not None or runner is not None:
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_config)
            self.runner = runner if runner is not None else build_runner(config, devices)
        else:  # the tokenizer loads while the weights load and the first buckets compile
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-tokenizer") as pool:
                pending = pool.submit(load_tokenizer, config.model_config)
                self.runner = build_runner(config, devices)
                self.tokenizer = pending.result()
        if runner is None and kv_scales.measured_at_startup(config.cache_config):
            self.runner.calibrate_kv_scales(
                kv_scales.calibration_ids(self.tokenizer, self.runner.args.vocab_size)
            )
        lora = config.lora_config
        self.draft = DraftModelProposer.of(config, self.runner)  # a draft model's proposer, if any
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, self.runner.num_blocks,
            lora.max_loras if lora else 0, clock, config.speculative_config, self.draft,
            SwapSpace.of(config, self.runner),
        )  # fmt: skip
        self.adapters = None  # LoRA adapters read from disk, by lora_int_id (lora/adapter.py)
        if lora is not None:
            self.adapters = AdapterCache(lora.max_cpu_loras or lora.max_loras, self.runner.adapter_spec)
        mc = config.model_config
        self.generation_config = read_generation_config(mc.model, mc.generation_config)
        self.sampling_defaults = sampling_defaults(self.generation_config, mc.override_generation_config)
        self.input_processor = InputProcessor(
            config, self.tokenizer, self.runner.args.vocab_size, self.generation_config, clock
        )
        self.grammars = self.input_processor.grammars
        self.output_processor = OutputProcessor(self.tokenizer, clock, mc.pooler_config)
        self.iteration_stats = IterationStats()  # of the last step
        self._between_steps = IterationStats()  # aborts since the last step, counted with the next
        self.async_scheduling = config.scheduler_config.async_scheduling
        self._in_flight: Dispatched | None = None  # dispatched, not collected yet
        self.pacer = StepPacer(clock=clock)  # when the server's loop plans the next step (async)
        self._counter = itertools.count()
        self._released: tuple[str, ...] = ()  # what sleep() freed and wake_up() has not taken back
        self.tracer = None  # a span per finished request (engine/tracing.py), sent as it is recorded
        if config.otlp_traces_endpoint:
            name = mc.served_model_name[0] if mc.served_model_name else mc.model
            self.tracer = self.output_processor.tracer = RequestTracer(config.otlp_traces_endpoint, name)

    @classmethod
    def from_engine_args(cls, engine_args) -> LLMEngine:
        """engine_args: an EngineArgs (args.py, which sits above the engine)."""
        return cls(engine_args.create_engine_config())

    @property
    def eos_token_id(self) -> int | None:
        return self.input_processor.eos_token_id

    # ---- requests ------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize_prompt(prompt)

    def check_prompt_token_ids(self, token_ids: Sequence[int]) -> None:
        self.input_processor.check_prompt_token_ids(token_ids)

    def expand_images(self, prompt: Mapping) -> dict:
        return self.input_processor.expand_images(prompt)  # (ValueError on bad images)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input."""
        self.enqueue(self.make_request(request_id, prompt, params, priority, arrival_time, lora_request))

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> ParentRequest:
        """Check and tokenize a request and build its child sequences; ValueError on bad
        input. Reads nothing that steps change, so a server may call it off the engine's thread
        (enqueue checks that the id is free). trace_headers: the W3C trace context its span
        joins (--otlp-traces-endpoint)."""
        if lora_request is not None:
            if self.adapters is None:
                raise ValueError(
                    f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not enabled (--enable-lora)."
                )
            self.adapters.get(lora_request)  # read now: a bad adapter fails the request, never a step
        parent = self.input_processor.process(request_id, prompt, params, priority, arrival_time)
        for child in parent.children:
            child.lora_request = lora_request
        parent.trace_headers = trace_headers
        return parent

    def enqueue(self, parent: ParentRequest) -> None:
        """Hand a request built by make_request to the scheduler; ValueError (nothing queued)
        if its id, or one of its sequences', is in use."""
        ids = [parent.request_id, *(c.request_id for c in parent.children)]
        if parent.request_id in self.output_processor.parents or any(
            i in self.scheduler.requests for i in ids
        ):
            raise ValueError(f"Request id {parent.request_id!r} is already in use.")
        for child in parent.children:
            self.scheduler.add_request(child)
        self.output_processor.add(parent)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            parent = self.output_processor.pop(rid)
            if parent is None:
                continue
            self.scheduler.finish_requests(
                [c.request_id for c in parent.children], RequestStatus.FINISHED_ABORTED
            )
            self.output_processor.record_finished(self._between_steps, parent, self.clock())

    def abort_all(self) -> None:
        self.abort_request(list(self.output_processor.parents))

    def settle(self) -> list[RequestOutput]:
        """Collect the step still in flight, if any (counted with the next step): its outputs. How
        a stopping engine (its requests aborted) leaves nothing on the device nor in its state."""
        in_flight, self._in_flight = self._in_flight, None
        return [] if in_flight is None else self._finish(in_flight, self._between_steps)

    # ---- sleep mode -----------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        """Asleep: something is off the devices, and no step runs until it is back."""
        return bool(self._released)

    def sleep(self, level: int = 1) -> list[RequestOutput]:
        """Free the weights and the KV cache on the devices (enable_sleep_mode). Level 1 keeps
        the weights in host memory; level 2 does not, and waking reads the checkpoint again.
        Requests running now are preempted (they recompute once awake) and new ones wait; the
        prefix cache is emptied. Returns the outputs of the step that was in flight."""
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError("Sleep mode is not enabled: start the engine with --enable-sleep-mode.")
        if level not in (1, 2):
            raise ValueError(f"The sleep level must be 1 or 2, got {level!r}.")
        outputs = self.settle()
        self.scheduler.drop_all_kv()
        start = time.perf_counter()
        freed = self.runner.sleep(level) + (self.draft.sleep(level) if self.draft else 0)
        self._released = tuple(self.runner.released)
        logger.info(
            "Asleep (level %d): freed %.2f GiB of device memory in %.2f s",
            level,
            freed / 2**30,
            time.perf_counter() - start,
        )
        return outputs

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take back what sleep() freed: all of it, or the parts `tags` names ("weights",
        "kv_cache"); steps run again once nothing is missing."""
        tags = SLEEP_TAGS if tags is None else tuple(tags)
        unknown = sorted(set(tags) - set(SLEEP_TAGS))
        if unknown:
            raise ValueError(f"Unknown wake_up tags {unknown}; known: {list(SLEEP_TAGS)}.")
        start = time.perf_counter()
        self.runner.wake_up(tags)
        if self.draft is not None:
            self.draft.wake_up(tags)
        self._released = tuple(self.runner.released)
        logger.info(
            "Woke %s in %.2f s%s",
            " and ".join(t for t in SLEEP_TAGS if t in tags),
            time.perf_counter() - start,
            f"; still asleep: {', '.join(self._released)}" if self._released else "",
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (their pages are reused as free ones); False when pages
        are in use by running requests, and nothing was reset."""
        return self.scheduler.reset_prefix_cache()

    # ---- what a server asks of the engine besides steps ----------------------------------

    def share_grammars(self, other: LLMEngine) -> None:
        """Compile structured-output grammars in `other`'s cache (data-parallel replicas: a
        schema the server checked compiles once for all of them)."""
        self.input_processor.grammars = self.grammars = other.grammars

    def check_structured_outputs(self, params) -> None:
        """Compile a request's grammar (cached for when the request is made); ValueError naming
        what is wrong with it."""
        self.grammars.compile(params)

    def check_lora(self, lora_request) -> None:
        """Read a LoRA adapter as a request naming it would (ValueError, one line, if it cannot
        be served; LookupError if LoRA is not enabled)."""
        if self.adapters is None:
            raise LookupError("LoRA is not enabled on this server (--enable-lora).")
        self.adapters.get(lora_request)

    @property
    def num_kv_blocks(self) -> int:
        """Pages in the KV pool."""
        return self.runner.num_blocks

    @property
    def tracing(self) -> bool:
        """Finished requests are exported as spans (--otlp-traces-endpoint)."""
        return self.tracer is not None

    def stop_compiling(self) -> None:
        """End the start-up compiles still under way after their current bucket."""
        self.runner.stop_compiling()

    def close_workers(self) -> None:
        """Tell the other processes of a multi-process engine, if any, to stop with this one."""
        channel = self.runner.channel
        if channel is not None:
            from jaxserve import distributed

            distributed.closing()
            channel.publish("stop")

    def seconds_until_next_step(self) -> float:
        """How long the server's loop may wait for more requests before planning the next step
        (asynchronous scheduling: until shortly before the step in flight is expected to end); 0:
        plan it now. A loop that sleeps this long should be woken if the step ends sooner (see
        in_flight_waiter); seconds on the engine's clock."""
        at = self.pacer.plan_at() if self.async_scheduling and self._in_flight is not None else None
        if at is None or self.runner.is_ready(self._in_flight.handle):
            return 0.0
        return max(0.0, at - self.clock())

    def in_flight_waiter(self) -> Callable[[], None] | None:
        """A call that blocks, on any thread, until the step now in flight has ended on the device:
        a thread that runs it can wake the server's loop then, which otherwise has to ask every
        few milliseconds. None: no step in flight."""
        if self._in_flight is None:
            return None
        return functools.partial(self.runner.wait_ready, self._in_flight.handle)

    def has_unfinished_requests(self) -> bool:
        """Requests alive, or a step still in flight (the next step() collects it)."""
        return bool(self.output_processor.parents) or self._in_flight is not None

    def new_request_id(self) -> str:
        return str(next(self._counter))

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns a RequestOutput for every request that changed.

        Synchronous: schedule, run and finish one step. Asynchronous: schedule and dispatch the
        next step, then finish the one in flight (first, if the new step needs its tokens)."""
        if self._released:  # asleep: requests wait for wake_up
            return []
        started = self.clock()
        outputs = self._finish_blocking_step()
        sched = self.scheduler.schedule(max_tokens=self.runner.ready_token_budget)
        stats = self._start_iteration(sched)
        previous, self._in_flight = self._in_flight, self._dispatch(sched, outputs, started)
        if previous is not None:
            outputs += self._finish(previous, stats)
        if not self.async_scheduling and self._in_flight is not None:
            outputs += self._finish(self._in_flight, stats)
            self._in_flight = None
        return outputs

    def _finish_blocking_step(self) -> list[RequestOutput]:
        """Finish the step in flight now if the next one cannot be planned without its tokens."""
        if self._in_flight is None or not self.scheduler.needs_tokens_before_next(self._in_flight.sched):
            return []
        return self.settle()

    def _dispatch(
        self, sched: SchedulerOutput, outputs: list[RequestOutput], started: float
    ) -> Dispatched | None:
        """Start a step on the device: the step and the runner's handle, or None when there is
        nothing to run or it failed to start (its requests' failures go to `outputs`)."""
        if sched.is_empty:
            return None
        try:
            for slot, lora_request in sched.lora_loads:  # adapters new to their slots
                self.runner.set_lora_slot(slot, self.adapters.get(lora_request))
            handle = self.runner.dispatch(
                sched, bitmask_filler(self.grammars, sched, self.scheduler.requests)
            )
        except Exception as e:
            outputs += self._fail_step(sched, e)
            return None
        self.pacer.dispatched(sched.num_tokens, started)
        return Dispatched(sched, handle)

    def _finish(self, in_flight: Dispatched, stats: IterationStats) -> list[RequestOutput]:
        """Collect a dispatched step's results and turn them into request state and outputs."""
        sched, handle = in_flight
        waited = not self.runner.is_ready(handle)
        try:
            runner_out = self.runner.collect(handle)
        except Exception as e:
            self.pacer.forget()
            return self._fail_step(sched, e)
        self.pacer.collected(waited)
        updated = self.scheduler.update(sched, runner_out)
        self.scheduler.stop_on_strings(self.output_processor.detokenize(updated))
        return self.output_processor.make_outputs(updated, stats)

    def _start_iteration(self, sched: SchedulerOutput) -> IterationStats:
        """This step's stats, which start with the aborts counted since the last step."""
        self.iteration_stats, self._between_steps = self._between_steps, IterationStats()
        self.iteration_stats.num_scheduled_tokens = sched.num_tokens
        return self.iteration_stats

    def _fail_step(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """The device call failed: fail every request that had a row in the step, keep the
        rest. If the failure took the KV pool with it (it is donated to the call), every
        live request's KV is gone: the pool is rebuilt and the survivors recompute."""
        logger.error("Engine step failed; failing the requests in it", exc_info=error)
        self.scheduler.forget(sched)
        message = "The engine failed while running this request (the server log has the details)."
        outputs = []
        for rid in self.output_processor.parent_ids([s.request_id for s in sched.seqs]):
            parent = self.output_processor.pop(rid)
            self.scheduler.finish_requests(
                [c.request_id for c in parent.children], RequestStatus.FINISHED_ERROR
            )
            out = self.output_processor.make_output(parent)
            out.error = message
            outputs.append(out)
        if self.runner.kv_pool_lost:
            try:
                self.runner.reset_kv_pool()
            except Exception as e:
                raise EngineDeadError(f"cannot rebuild the KV cache after a failed step: {e}") from e
            self.scheduler.drop_all_kv()
        return outputs

    def flush_stats(self) -> IterationStats | None:
        """Stats of what happened since the last step (aborts), if anything; for an idle
        engine, which has no next step to carry them."""
        if not self._between_steps.finished:
            return None
        stats, self._between_steps = self._between_steps, IterationStats()
        return stats

    def scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats.of(self.scheduler)
