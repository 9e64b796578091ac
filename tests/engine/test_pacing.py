"""Pacing under asynchronous scheduling: the next step is planned shortly before the step in
flight is expected to end, so that a request arriving meanwhile joins it instead of the one after.

StepPacer on made-up times; then the server's engine thread (pacing.take_turn, as AsyncLLMEngine
runs it) on a simulated clock over a fake device whose steps take a fixed time (tests/fakes.py):
a request that arrives while a step runs has its prefill in the very next step, where planning a
whole step ahead puts one more step before it. The thread sleeps until its planned time or until
the watcher sees the step in flight end. The assertions are on the order of steps and arrivals on
that clock, which no load on the machine can change; one test runs the real threads."""

from __future__ import annotations

import threading
import time

import pytest
from fakes import SimClock, Simulation, TimedRunner, WallClock, fake_engine

from jaxserve import SamplingParams
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
    assert pacer.recent_durations(8) == [3.0, 3.0]  # when it started is not known well enough to count
    # a loop that came to plan late, after the step in flight had ended: the next one started
    # when it was dispatched, which the host knows to within the moments before it looked
    pacer.dispatched(8, end + 3.1, end + 3.1)
    pacer.dispatched(8, end + 6.2, end + 6.2)
    pacer.collected(waited=False, now=end + 6.2)
    assert pacer.plan_at() == pytest.approx(end + 9.2)
    pacer.collected(waited=True, now=end + 9.3)
    assert pacer.recent_durations(8) == [3.0, 3.0, pytest.approx(3.1)]
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
    assert pacer.recent_durations(8) == [3.0, 3.0, 3.0, pytest.approx(0.5)]


STEP = 0.15  # seconds each simulated device step takes


def _simulation(model: str, **engine_args) -> Simulation:
    clock = SimClock()
    engine = fake_engine(model, TimedRunner.factory(clock, STEP), clock, async_scheduling=True, **engine_args)
    return Simulation(engine)


def _first_step_with(runner: TimedRunner, request_id: str) -> int:
    return next(i for i, step in enumerate(runner.timeline) if request_id in step.request_ids)


@pytest.mark.parametrize(
    "paced, woken_late",
    [(True, False), (True, True), (False, False)],
    ids=["paced", "woken-late", "a-step-ahead"],
)
def test_a_request_arriving_during_a_step_joins_the_next_one(tiny_llama_gqa, paced, woken_late, monkeypatch):
    """A long request decodes; a short one arrives a third of the way into a step. Paced, its
    prefill is in the very next step and the device never idles; planned a whole step ahead, one
    more step comes before it. woken_late: the engine thread, kept busy, came to plan the step the
    request arrives in only after the one before had ended (the device idled meanwhile); that must
    not put the next step ahead."""
    sim = _simulation(tiny_llama_gqa[0])
    runner = sim.runner
    if not paced:
        monkeypatch.setattr(LLMEngine, "seconds_until_next_step", lambda self: 0.0)
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    sim.arrive(sim.clock(), "long", [5, 6, 7], long)
    sim.run(until=lambda: len(runner.timeline) > 6)  # the pacer has measured decode steps
    arrive_in = 6
    if woken_late:  # the thread cannot wake from step 6's start until a fifth of a step after its end
        sim.busy.append((runner.timeline[6].start, runner.timeline[6].end + STEP / 5))
        sim.run(until=lambda: len(runner.timeline) > 7)
        arrive_in = 7
    sim.arrive(runner.timeline[arrive_in].start + STEP / 3, "late", [9, 10], SamplingParams(max_tokens=2))
    sim.run(until=lambda: sim.finished("late"))
    steps = runner.timeline
    first = _first_step_with(runner, "late")
    assert steps[arrive_in].start < sim.arrived["late"] < steps[arrive_in].end
    # the steps dispatched after it arrived and before its own
    between = [s for s in steps[:first] if s.start > sim.arrived["late"]]
    assert len(between) == (0 if paced else 1)
    assert [out.outputs[0].token_ids for out in sim.outputs["late"]][-1] == [11, 12]
    if woken_late:  # the late wake-up happened: the device idled before the step it came in
        assert steps[7].start - steps[6].end == pytest.approx(STEP / 5 + runner.host_s)
        assert all(gap == 0 for i, gap in enumerate(runner.gaps()) if i != 6)
    elif paced:  # and the device was kept busy: each step planned before the one ahead ended
        assert all(gap == 0 for gap in runner.gaps())


def test_a_guess_far_too_long_neither_stalls_the_loop_nor_lasts(tiny_llama_gqa):
    """Step lengths measured while the machine was busy elsewhere (100x the real ones): the thread
    still plans each step as soon as the one in flight is done (the watcher wakes it), and the
    guess comes down to the truth."""
    sim = _simulation(tiny_llama_gqa[0])
    for num_tokens in (1, 2, 4, 8, 16):
        sim.engine.pacer.expect(num_tokens, [100 * STEP] * 4)
    sim.arrive(sim.clock(), "r", [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True))
    sim.run(until=lambda: sim.finished("r"))
    assert max(sim.runner.gaps()) <= sim.runner.host_s  # planned at each end, started at once
    assert sim.clock() - sim.runner.timeline[0].start < 14 * STEP
    assert min(sim.engine.pacer.recent_durations(1)) == pytest.approx(STEP)  # the decode steps' guess


def test_the_loop_sleeps_through_a_step(tiny_llama_gqa):
    """The engine thread wakes a few times per step (to plan it, at the planned time or the step's
    end), never polling: a wake-up takes a core from a step that runs on the same cores."""
    sim = _simulation(tiny_llama_gqa[0])
    sim.arrive(sim.clock(), "r", [5, 6, 7], SamplingParams(max_tokens=24, ignore_eos=True))
    sim.run(until=lambda: sim.finished("r"))
    assert len(sim.runner.timeline) == 24
    assert sim.turns <= 2 * len(sim.runner.timeline) + 2
    assert all(gap == 0 for gap in sim.runner.gaps())


def test_the_engine_clock_times_requests(tiny_llama_gqa):
    """Arrival, first-token and finish times come from the engine's clock: on a simulated one the
    metrics are exact."""
    sim = _simulation(tiny_llama_gqa[0])
    sim.arrive(sim.clock() + 1.0, "r", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    finished = []
    real_step = sim.engine.step

    def step():
        outputs = real_step()
        finished.extend(sim.engine.iteration_stats.finished)
        return outputs

    sim.engine.step = step
    sim.run(until=lambda: sim.finished("r"))
    (stats,) = finished
    steps = sim.runner.timeline
    assert stats.arrival_time == sim.arrived["r"]
    assert stats.time_to_first_token == pytest.approx(steps[0].end - sim.arrived["r"])
    assert stats.e2e_latency == pytest.approx(steps[2].end - sim.arrived["r"])


async def test_shutdown_waits_for_the_watcher_to_leave_the_device_wait(tiny_llama_gqa):
    """A watcher thread still inside the device runtime when the interpreter exits aborts the
    process (a server stopped by SIGINT exited with SIGABRT): shutdown ends it first."""
    engine = fake_engine(tiny_llama_gqa[0], TimedRunner.factory(WallClock(), STEP), async_scheduling=True)
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
    assert engine.runner.timeline[-1].end <= time.monotonic()
    await stream.aclose()
