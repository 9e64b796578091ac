"""Pacing under asynchronous scheduling: the next step is planned shortly before the step in
flight is expected to end, so that a request arriving meanwhile joins it instead of the one after.

StepPacer on made-up times, then the server's engine loop (AsyncLLMEngine) over a fake device whose
steps take a fixed time: a request that arrives while a step runs has its prefill in the very next
step, where planning a whole step ahead puts one more step before it. The loop sleeps until its
planned time or until a watcher thread sees the step in flight end; with a runner that cannot be
waited on it asks every few milliseconds instead."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import pytest
from test_engine_with_fake_runner import FakeRunner
from tiny_models import engine_kwargs

from jaxserve import SamplingParams
from jaxserve.args import EngineArgs
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.pacing import StepPacer, size_class


def test_size_classes_round_up_to_powers_of_two():
    assert [size_class(n) for n in (1, 2, 3, 4, 5, 8, 9, 256, 257)] == [1, 2, 4, 4, 8, 8, 16, 256, 512]


def _back_to_back(pacer: StepPacer, durations: list[float], num_tokens: int = 8) -> float:
    """Steps of `durations` run one after another, each dispatched 1 s (of host planning that
    took 0.5 ms) into the one before, as asynchronous scheduling does; returns the last end."""
    t = 100.0
    pacer.dispatched(num_tokens, t - 0.0005, t)  # the device is idle: this one starts now
    end = t + durations[0]
    for d in durations[1:]:
        pacer.dispatched(num_tokens, end - 1.0005, end - 1.0)  # queued behind the running one
        pacer.collected(waited=True, now=end)  # the host waited for the running one: it ends now
        end += d
    return end


def test_the_next_step_is_planned_before_the_step_in_flight_ends():
    pacer = StepPacer(margin_s=0.001, host_factor=2.0)
    assert pacer.plan_at() is None  # nothing in flight
    pacer.dispatched(8, 99.9995, 100.0)
    assert pacer.plan_at() is None  # no step of this size measured yet
    pacer.collected(waited=True, now=103.0)
    pacer = StepPacer(margin_s=0.001, host_factor=2.0)
    end = _back_to_back(pacer, [3.0, 3.2, 2.9, 3.1])
    # the last step started when the one before ended (end - 3.1) and steps of its size take at
    # least 2.9 s; planning and dispatching take 0.5 ms, counted twice, plus the 1 ms margin
    assert pacer.plan_at() == pytest.approx(end - 3.1 + 2.9 - 0.001 - 0.001)


def test_only_the_last_four_steps_of_a_size_count_and_sizes_are_apart():
    pacer = StepPacer(margin_s=0.0, host_factor=0.0)
    # the last (9.0) is in flight; of the five measured, the 1.0 is forgotten
    end = _back_to_back(pacer, [1.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    assert pacer.plan_at() == pytest.approx(end - 9.0 + 5.0)
    pacer.collected(waited=True, now=end)
    pacer.dispatched(200, end + 0.1, end + 0.2)  # another size: never measured
    assert pacer.plan_at() is None


def test_a_step_queued_behind_one_whose_end_was_not_seen_is_planned_from_its_dispatch():
    pacer = StepPacer(margin_s=0.0, host_factor=0.0)
    end = _back_to_back(pacer, [3.0, 3.0, 3.0])
    pacer.dispatched(8, end - 1.0, end - 1.0)
    pacer.collected(waited=False, now=end + 0.5)  # done before the host came: it ended unseen
    # so the one queued behind it started between its dispatch and now: planned from the earlier
    assert pacer.plan_at() == pytest.approx(end - 1.0 + 3.0)
    pacer.collected(waited=True, now=end + 3.0)
    assert pacer._durations[8] == [3.0, 3.0]  # when it started is not known well enough to count
    # a loop that came to plan late, after the step in flight had ended: the next one started
    # when it was dispatched, which the host knows to within the moments before it looked
    pacer.dispatched(8, end + 3.1, end + 3.1)
    pacer.dispatched(8, end + 6.2, end + 6.2)
    pacer.collected(waited=False, now=end + 6.2)
    assert pacer.plan_at() == pytest.approx(end + 9.2)
    pacer.collected(waited=True, now=end + 9.3)
    assert pacer._durations[8] == [3.0, 3.0, pytest.approx(3.1)]
    pacer.forget()
    pacer.collected(waited=True)  # (after a failed step: nothing left to collect)
    assert pacer.plan_at() is None


def test_a_step_found_ended_early_lowers_a_longer_guess():
    pacer = StepPacer(margin_s=0.0, host_factor=0.0)
    end = _back_to_back(pacer, [3.0, 3.0, 3.0])  # measured while the device was slow
    pacer.collected(waited=True, now=end)
    pacer.dispatched(8, end + 1.0, end + 1.0)  # the device was idle: the last one started here
    pacer.collected(waited=False, now=end + 1.5)  # ... and was over within 0.5 s
    pacer.dispatched(8, end + 2.0, end + 2.0)
    assert pacer.plan_at() == pytest.approx(end + 2.5)
    pacer.dispatched(8, end + 2.1, end + 2.1)
    pacer.collected(waited=False, now=end + 4.0)  # an end seen late bounds nothing new
    assert pacer._durations[8] == [3.0, 3.0, 3.0, pytest.approx(0.5)]


class TimedRunner(FakeRunner):
    """FakeRunner on a device whose every step takes STEP seconds, one after another."""

    STEP = 0.15

    def __init__(self, *args):
        super().__init__(*args)
        self.free_at = 0.0
        self.timeline: list[tuple[float, float, tuple[str, ...]]] = []  # (start, end, row ids)

    def dispatch(self, sched, fill_bitmask=None):
        answer = super().dispatch(sched, fill_bitmask)
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + self.STEP
        self.timeline.append((start, self.free_at, tuple(s.request_id for s in sched.seqs)))
        return answer, self.free_at

    def stop_compiling(self) -> None:
        pass

    def is_ready(self, handle) -> bool:
        return time.perf_counter() >= handle[1]

    def collect(self, handle):
        time.sleep(max(0.0, handle[1] - time.perf_counter()))
        return handle[0]


class WatchedRunner(TimedRunner):
    """TimedRunner whose steps can be waited on without collecting them, as ModelRunner's."""

    def wait_ready(self, handle) -> None:
        time.sleep(max(0.0, handle[1] - time.perf_counter()))


RUNNERS = pytest.mark.parametrize("runner_class", [WatchedRunner, TimedRunner], ids=["watched", "polled"])


def _timed_engine(model: str, runner_class: type[TimedRunner]) -> LLMEngine:
    kwargs = engine_kwargs(max_num_seqs=4, num_gpu_blocks_override=32)
    kwargs.pop("compilation_config")
    config = EngineArgs(model=model, async_scheduling=True, **kwargs).create_engine_config()
    runner = runner_class(config.cache_config.num_gpu_blocks_override, config.model_config.get("vocab_size"))
    return LLMEngine(config, runner=runner)


def _running(timeline: list, now: float) -> tuple[float, float, tuple[str, ...]] | None:
    return next((step for step in reversed(timeline) if step[0] <= now < step[1]), None)


async def _arrive_inside_a_step(
    server: AsyncLLMEngine, runner: TimedRunner, long, wake_late: threading.Event | None
) -> tuple[str, float]:
    """Queue a short request a third of the way into a step of `long` (a few steps in, once the
    pacer has measured them): its id and when it was queued by. wake_late: set during the step
    before that one, so that the loop comes late to plan it. A machine busy elsewhere can delay
    this task past the middle of the step, where the next step may rightly be planned already:
    such a try is let finish and another made on a later step."""
    for attempt in range(6):
        for _ in range(3 if attempt else 6):
            await anext(long)
        step = _running(runner.timeline, time.perf_counter())
        if step is None:
            continue
        if wake_late is not None:  # the loop wakes late for the step after this one: wait for it
            ahead = step
            wake_late.set()
            while (step := _running(runner.timeline, time.perf_counter())) is None or step[1] <= ahead[1]:
                await asyncio.sleep(0.001)
        await asyncio.sleep(max(0.0, step[0] + TimedRunner.STEP / 3 - time.perf_counter()))
        late = server.generate({"prompt_token_ids": [9, 10]}, SamplingParams(max_tokens=2), f"late{attempt}")
        first = asyncio.ensure_future(anext(late))
        await asyncio.sleep(0)  # the task runs until it waits for an output: queued by now
        arrived = time.perf_counter()
        await first
        async for _ in late:
            pass
        if arrived < step[0] + TimedRunner.STEP / 2:
            return f"late{attempt}", arrived
    raise AssertionError("no request could be queued inside the first half of a step")


@RUNNERS
@pytest.mark.parametrize(
    "paced, woken_late",
    [(True, False), (True, True), (False, False)],
    ids=["paced", "woken-late", "a-step-ahead"],
)
async def test_a_request_arriving_during_a_step_joins_the_next_one(
    tiny_llama_gqa, paced, woken_late, runner_class, monkeypatch
):
    """woken_late: the loop's thread, kept busy, came to plan the step that is running only after
    the one before had ended (the device idled meanwhile); that must not put the next step ahead."""
    engine = _timed_engine(tiny_llama_gqa[0], runner_class)
    runner = engine.runner
    if not paced:
        monkeypatch.setattr(LLMEngine, "seconds_until_next_step", lambda self: 0.0)
    wake_late = threading.Event() if woken_late else None
    if woken_late:
        step = LLMEngine.step

        def late_step(self):
            if self._in_flight is not None and wake_late.is_set():
                wake_late.clear()
                time.sleep(TimedRunner.STEP / 5)
            return step(self)

        monkeypatch.setattr(LLMEngine, "step", late_step)
    server = AsyncLLMEngine(engine)
    server.start()
    try:
        params = SamplingParams(max_tokens=60, ignore_eos=True)
        long = server.generate({"prompt_token_ids": [5, 6, 7]}, params, "long")
        late, arrived = await _arrive_inside_a_step(server, runner, long, wake_late)
        await long.aclose()
    finally:
        server.shutdown()
    timeline = runner.timeline
    first = next(start for start, _, ids in timeline if late in ids)
    between = [start for start, _, _ in timeline if arrived < start < first]
    assert len(between) == (0 if paced else 1)
    if paced and not woken_late:  # and the device was kept busy: each step there before the one ahead ended
        gaps = [b[0] - a[1] for a, b in zip(timeline, timeline[1:])]
        assert statistics.median(gaps) < TimedRunner.STEP / 5
    if woken_late:  # (the late wake-up happened: the device idled before the step the request came in)
        running = _running(timeline, arrived)
        assert running[0] > max(end for _, end, _ in timeline if end <= running[0])


@RUNNERS
async def test_a_guess_far_too_long_neither_stalls_the_loop_nor_lasts(tiny_llama_gqa, runner_class):
    """Step lengths measured while the machine was busy elsewhere (100x the real ones): the loop
    still plans each step once the one in flight is done, and the guess comes down to the truth."""
    engine = _timed_engine(tiny_llama_gqa[0], runner_class)
    runner = engine.runner
    slow = 100 * TimedRunner.STEP
    engine.pacer._durations = {size: [slow] * 4 for size in (1, 2, 4, 8, 16)}
    server = AsyncLLMEngine(engine)
    server.start()
    try:
        params = SamplingParams(max_tokens=12, ignore_eos=True)

        async def run() -> None:
            async for _ in server.generate({"prompt_token_ids": [5, 6, 7]}, params, "r"):
                pass

        await asyncio.wait_for(run(), 30 * TimedRunner.STEP)
    finally:
        server.shutdown()
    gaps = [b[0] - a[1] for a, b in zip(runner.timeline, runner.timeline[1:])]
    assert max(gaps) < TimedRunner.STEP / 3
    assert min(engine.pacer._durations[1]) < 1.5 * TimedRunner.STEP  # the decode steps' guess


@RUNNERS
async def test_the_loop_sleeps_through_a_step_when_it_can_be_woken_at_its_end(
    tiny_llama_gqa, runner_class, monkeypatch
):
    """With a runner whose steps can be waited on, the loop wakes a few times per step (its planned
    time, the step's end); without, it asks every StepPacer.POLL_S, and each wake-up takes a core
    from a step that runs on the same cores."""
    engine = _timed_engine(tiny_llama_gqa[0], runner_class)
    asked = []
    real = LLMEngine.seconds_until_next_step
    monkeypatch.setattr(LLMEngine, "seconds_until_next_step", lambda self: asked.append(1) or real(self))
    server = AsyncLLMEngine(engine)
    server.start()
    try:
        async for _ in server.generate(
            {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=12, ignore_eos=True), "r"
        ):
            pass
    finally:
        server.shutdown()
    per_step = len(asked) / len(engine.runner.timeline)
    if runner_class is WatchedRunner:
        assert per_step <= 5
    else:
        assert per_step >= 10


async def test_shutdown_waits_for_the_watcher_to_leave_the_device_wait(tiny_llama_gqa):
    """A watcher thread still inside the device runtime when the interpreter exits aborts the
    process (a server stopped by SIGINT exited with SIGABRT): shutdown ends it first."""
    engine = _timed_engine(tiny_llama_gqa[0], WatchedRunner)
    server = AsyncLLMEngine(engine)
    server.start()
    stream = server.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50, ignore_eos=True), "r"
    )
    for _ in range(3):
        await anext(stream)
    assert any(t.name == "jaxserve-step-watcher" for t in threading.enumerate())
    server.shutdown()  # with a step in flight
    assert not any(t.name == "jaxserve-step-watcher" for t in threading.enumerate())
    assert not engine.has_unfinished_requests()  # the aborted request and the step in flight are gone
    assert engine.runner.free_at <= time.perf_counter()
    await stream.aclose()
