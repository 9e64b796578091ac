"""The test doubles, in one place: the models and runners that stand in for the device, and a
clock the tests move themselves.

- FakeModel answers a Scheduler's steps directly (no engine): it keeps its own paged "KV cache"
  (page, slot) -> token, writes the fed tokens where the page table says and reads the whole
  context back through the page table before it samples, so a wrong page table, a page shared
  when it should not be, or a prefix-cache hit on the wrong page shows up as a context that
  differs from the request's tokens. The sampled token is a hash of that context
  (context_token), so a request's output depends only on its prompt: any schedule (chunked,
  preempted, cached, overlapped) must produce the same outputs.
- FakeRunner is LLMEngine's device side (scheduler_output.StepRunner) answering at once.
- TimedRunner is a FakeRunner on a device whose steps take a set time, one after another, on a
  SimClock (or the wall clock); Simulation runs a server's engine thread (pacing.take_turn) on
  that SimClock with requests arriving at set times, so pacing is tested by the order of steps
  and arrivals, never by wall-clock gaps.

Nothing here imports jax.
"""

from __future__ import annotations

import time
import types
import zlib
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from jaxserve.engine.pacing import take_turn
from jaxserve.scheduler_output import PLACEHOLDER_TOKEN, ModelRunnerOutput, SchedulerOutput, TopLogprobs

if TYPE_CHECKING:
    from jaxserve.engine.request import Request
    from jaxserve.engine.scheduler import Scheduler

EOS = 1
# Fake sampled tokens lie in [FIRST_FAKE_TOKEN, FIRST_FAKE_TOKEN + NUM_FAKE_TOKENS), away
# from EOS and from the stop token ids the tests choose.
FIRST_FAKE_TOKEN = 100
NUM_FAKE_TOKENS = 50


def context_token(context: list[int]) -> int:
    return FIRST_FAKE_TOKEN + zlib.crc32(np.asarray(context, np.int64).tobytes()) % NUM_FAKE_TOKENS


class FakeModel:
    def __init__(self, scheduler: Scheduler, token_fn: Callable[[Request, list[int]], int] | None = None):
        self.scheduler = scheduler
        self.block_size = scheduler.block_manager.block_size
        self.token_fn = token_fn or (lambda req, context: context_token(context))
        self.kv: dict[tuple[int, int], int] = {}
        self.seen: dict[str, Request] = {}  # a request aborted after schedule() still runs
        self.last_sampled: dict[int, int] = {}  # row -> token sampled there, in the last call

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        req_ids, tokens, sampled, counts = [], [], {}, []
        for row, seq in enumerate(out.seqs):
            req = self.scheduler.requests.get(seq.request_id) or self.seen[seq.request_id]
            self.seen[seq.request_id] = req
            end = seq.start_pos + seq.num_new
            assert seq.num_new > 0
            assert 0 not in seq.block_ids, "the null page must never be handed out"
            assert len(seq.block_ids) * bs >= end
            fed, expected = list(seq.token_ids), req.all_token_ids
            if seq.feed_from_row >= 0:  # the token the last call sampled and the host lacks
                assert fed[-1] == PLACEHOLDER_TOKEN and end == req.num_tokens + 1
                fed[-1] = self.last_sampled[seq.feed_from_row]
                expected = expected + [fed[-1]]
            if seq.num_drafts:  # proposed tokens follow the request's own
                assert seq.feed_from_row < 0 and seq.sampling is not None
                expected = expected + fed[-seq.num_drafts :]
            assert fed == expected[seq.start_pos : end]
            for pos, token in enumerate(fed, start=seq.start_pos):
                self.kv[(seq.block_ids[pos // bs], pos % bs)] = token
            context = [self.kv.get((seq.block_ids[pos // bs], pos % bs)) for pos in range(end)]
            assert context == expected[:end], f"{req} read a corrupted context"
            if seq.sampling is not None:
                assert end == len(expected)
                assert seq.sampling.output_start == req.num_prompt_tokens
                assert seq.sampling.seed == req.seed
                req_ids.append(seq.request_id)
                kept = self._verify(req, context, seq.num_drafts)
                tokens += kept
                counts.append(len(kept))
                sampled[row] = tokens[-1]
            else:
                assert end < len(expected)
        self.last_sampled = sampled
        return ModelRunnerOutput(
            req_ids=tuple(req_ids),
            sampled_token_ids=np.asarray(tokens, np.int32),
            logprobs=np.full(len(tokens), -0.5, np.float32),
            num_sampled=np.asarray(counts, np.int32) if any(s.num_drafts for s in out.seqs) else None,
        )

    def _verify(self, req: Request, context: list[int], num_drafts: int) -> list[int]:
        """The tokens sampled after the context's last num_drafts + 1 tokens, up to the first that
        differs from the proposal after it (all of them without proposals: one)."""
        kept = []
        for j in range(num_drafts + 1):
            kept.append(self.token_fn(req, context[: len(context) - num_drafts + j]))
            if j == num_drafts or kept[-1] != context[len(context) - num_drafts + j]:
                return kept
        return kept


class FakeRunner:
    """ModelRunner's interface without a device. Each sampled token is the row's last token + 1
    (mod the vocabulary), with logprob -(1 + seed % 5) / 10, so children of one request differ in
    cumulative logprob by their seeds."""

    def __init__(self, num_blocks: int, vocab_size: int):
        self.num_blocks = num_blocks
        self.args = types.SimpleNamespace(vocab_size=vocab_size)
        self.ready_token_budget = None  # the scheduler's own budget
        self.kv_pool_lost = False
        self.fail_next = 0  # steps to fail from now on
        self.steps: list[SchedulerOutput] = []
        self.last_tokens: list[int] = []  # each row's sampled token in the last step

    def dispatch(self, sched: SchedulerOutput, fill_bitmask=None) -> ModelRunnerOutput:
        """Answers at once; the handle is the answer. A token the host does not have yet is read
        from the previous step's rows, as the device does."""
        self.steps.append(sched)
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("the device is on fire")
        fed = [
            self.last_tokens[s.feed_from_row] if s.feed_from_row >= 0 else s.token_ids[-1] for s in sched.seqs
        ]
        assert all(t >= 0 for t in fed)
        self.last_tokens = [(t + 1) % self.args.vocab_size for t in fed]
        rows = [i for i, s in enumerate(sched.seqs) if s.sampling is not None]
        tokens = np.array([self.last_tokens[i] for i in rows], np.int32)
        logprobs = np.array([-(1 + sched.seqs[i].sampling.seed % 5) / 10 for i in rows], np.float32)
        top = None
        if any(
            sched.seqs[i].sampling.logprobs is not None for i in rows
        ):  # the sampled token is the likeliest
            top = TopLogprobs(
                ids=tokens[:, None], logprobs=logprobs[:, None], chosen_logprobs=logprobs,
                chosen_ranks=np.ones(len(rows), np.int32),
            )  # fmt: skip
        return ModelRunnerOutput(
            req_ids=tuple(sched.seqs[i].request_id for i in rows),
            sampled_token_ids=tokens,
            logprobs=logprobs,
            top_logprobs=top,
        )

    def is_ready(self, handle: ModelRunnerOutput) -> bool:
        return True

    def wait_ready(self, handle: ModelRunnerOutput) -> None:
        pass

    def collect(self, handle: ModelRunnerOutput) -> ModelRunnerOutput:
        return handle

    def stop_compiling(self) -> None:
        pass

    def reset_kv_pool(self) -> None:
        self.kv_pool_lost = False


def fake_engine(model: str, runner_factory: Callable | None = None, clock=time.monotonic, **engine_args):
    """An LLMEngine for the tiny checkpoint at `model` on a fake device: runner_factory(num_blocks,
    vocab_size) (default FakeRunner), the engine's clock `clock`; engine_args over a small pool."""
    from tiny_models import engine_kwargs

    from jaxserve.args import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine

    kwargs = engine_kwargs(max_num_seqs=4, num_gpu_blocks_override=32)
    kwargs.pop("compilation_config")
    config = EngineArgs(model=model, **{**kwargs, **engine_args}).create_engine_config()
    factory = runner_factory or FakeRunner
    runner = factory(config.cache_config.num_gpu_blocks_override, config.model_config.get("vocab_size"))
    return LLMEngine(config, runner=runner, clock=clock)


# ---- time ----------------------------------------------------------------------------------


class SimClock:
    """The engine's clock in a simulation: it moves only when told (a blocking wait is time
    passing)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def sleep_until(self, t: float) -> None:
        self.now = max(self.now, t)


class WallClock:
    """The real clock, with the same two calls as SimClock."""

    def __call__(self) -> float:
        return time.monotonic()

    def sleep_until(self, t: float) -> None:
        time.sleep(max(0.0, t - time.monotonic()))


class DeviceStep(NamedTuple):
    """One step on TimedRunner's device: when it ran, whose rows it had, its answer."""

    start: float
    end: float
    request_ids: tuple[str, ...]
    answer: ModelRunnerOutput


class TimedRunner(FakeRunner):
    """FakeRunner on a device whose every step takes `step_s`, one after another, on `clock`;
    planning and dispatching a step takes the host `host_s`. Waiting for a step moves the clock
    to its end; `timeline` lists the steps in dispatch order."""

    def __init__(
        self, num_blocks: int, vocab_size: int, clock=None, step_s: float = 0.15, host_s: float = 0.001
    ):
        super().__init__(num_blocks, vocab_size)
        self.clock = clock or WallClock()
        self.step_s, self.host_s = step_s, host_s
        self.timeline: list[DeviceStep] = []

    @classmethod
    def factory(cls, clock, step_s: float = 0.15, host_s: float = 0.001) -> Callable:
        return lambda num_blocks, vocab_size: cls(num_blocks, vocab_size, clock, step_s, host_s)

    def dispatch(self, sched: SchedulerOutput, fill_bitmask=None) -> DeviceStep:
        answer = super().dispatch(sched, fill_bitmask)
        self.clock.sleep_until(self.clock() + self.host_s)
        start = max(self.clock(), self.timeline[-1].end if self.timeline else 0.0)
        step = DeviceStep(start, start + self.step_s, tuple(s.request_id for s in sched.seqs), answer)
        self.timeline.append(step)
        return step

    def is_ready(self, step: DeviceStep) -> bool:
        return self.clock() >= step.end

    def wait_ready(self, step: DeviceStep) -> None:
        self.clock.sleep_until(step.end)

    def collect(self, step: DeviceStep) -> ModelRunnerOutput:
        self.clock.sleep_until(step.end)
        return step.answer

    def gaps(self) -> list[float]:
        """How long the device idled between consecutive steps."""
        return [b.start - a.end for a, b in zip(self.timeline, self.timeline[1:])]


class Simulation:
    """A server's engine thread on a SimClock, taking the real turns (pacing.take_turn): requests
    arrive at set times; the thread's waits end at their timeout, at an arrival, or when the step
    in flight ends (what the StepWatcher thread signals), whichever comes first; during a `busy`
    span (the thread kept from running: another thread holds the interpreter) it cannot wake."""

    def __init__(self, engine) -> None:
        self.engine, self.runner, self.clock = engine, engine.runner, engine.clock
        self.arrivals: list[tuple[float, str, dict, object]] = []
        self.arrived: dict[str, float] = {}  # request id -> when it was queued
        self.outputs: dict[str, list] = defaultdict(list)
        self.busy: list[tuple[float, float]] = []
        self.turns = 0
        self._watched_end: float | None = None

    def arrive(self, at: float, request_id: str, prompt_token_ids: list[int], params) -> None:
        self.arrivals.append((at, request_id, {"prompt_token_ids": prompt_token_ids}, params))

    def watch(self, wait) -> None:
        """The StepWatcher's part: it wakes the thread when the step in flight (the last one
        dispatched) ends."""
        self._watched_end = self.runner.timeline[-1].end if wait is not None else None

    def run(self, until: Callable[[], bool], max_turns: int = 10_000) -> None:
        for _ in range(max_turns):
            if until():
                return
            self._deliver()
            outputs, wait = take_turn(self.engine, self)
            self.turns += 1
            for out in outputs or ():
                self.outputs[out.request_id].append(out)
            if wait != 0:
                self._sleep(wait)
        raise AssertionError("the simulation did not reach its end")

    def finished(self, request_id: str) -> bool:
        outputs = self.outputs.get(request_id)
        return bool(outputs) and outputs[-1].finished

    def _deliver(self) -> None:
        for arrival in [a for a in self.arrivals if a[0] <= self.clock()]:
            self.arrivals.remove(arrival)
            at, request_id, prompt, params = arrival  # (a server stamps it on arrival: the inbox waits)
            self.engine.add_request(request_id, prompt, params, arrival_time=at)
            self.arrived[request_id] = at

    def _sleep(self, timeout: float | None) -> None:
        wakes = [a[0] for a in self.arrivals]
        if timeout is not None:
            wakes.append(self.clock() + timeout)
        if self._watched_end is not None:
            wakes.append(self._watched_end)
        if not wakes:
            raise AssertionError("the engine thread would sleep forever")
        t = max(min(wakes), self.clock())
        if self._watched_end is not None and self._watched_end <= t:
            self._watched_end = None  # the watcher's wake-up is taken
        for start, end in self.busy:
            if start <= t < end:
                t = end
        self.clock.sleep_until(t)
