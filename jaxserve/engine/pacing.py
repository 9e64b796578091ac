"""When to plan the next step under asynchronous scheduling.

Planning step N+1 while step N runs hides the host's work, but a request that arrives after N+1
was planned waits for N+1 to finish before its prefill starts: one step more to its first token
than with synchronous scheduling. The server's engine loop therefore plans N+1 as late as it
safely can: at the moment N is expected to end, less the time planning and dispatching take and
a margin. Requests that arrive until then join N+1.

The expectation comes from the steps themselves: a step that the host had to wait for ended when
that wait returned, and it started when it was dispatched or, queued behind the step before, when
that one ended: the difference is its time on the device. Durations are kept per step size (tokens,
rounded up to a power of two), the smallest recent one counting, so that a wrong guess errs towards
planning early (the old behaviour) rather than leaving the device idle. A step size never measured
is not waited for. A step found ended when the host came for it ended at some unseen time: the one
queued behind it started no earlier than its own dispatch and no later than that moment, and is
planned from the earlier bound (a loop that came late to plan a step, say on a loaded host, keeps
planning the next one late instead of a whole step ahead).

A guess that is too long (a step measured while another process held the cores) must not last:
a StepWatcher thread waits on the device for the step in flight and wakes the loop when it ends,
and the loop then plans at once; a step found ended when the host came for it ended no later than
then, which lowers a longer guess. (A loop that asked every few milliseconds instead would, on a
machine whose cores also run the step, slow the step itself.)

Every time here is on the engine's clock (LLMEngine.clock): a test runs the loop's turns on a
clock it advances itself and asserts the order of steps and arrivals, not wall-clock gaps.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


def size_class(num_tokens: int) -> int:
    """Steps of similar cost: their token count rounded up to a power of two."""
    return 1 << max(num_tokens - 1, 0).bit_length()


@dataclass
class _Queued:
    """A step dispatched and not collected: its size class, the earliest and latest time it may
    have started on the device (None: not known yet), and when it was dispatched."""

    size: int
    earliest: float | None
    latest: float | None
    dispatched: float


class StepPacer:
    def __init__(
        self,
        margin_s: float | None = None,
        host_factor: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # kept free before the expected end besides the host's own time; by default Python's
        # thread switch interval, the longest the waiting thread may wait for the interpreter
        # while another thread of the server (streaming outputs) holds it
        self.margin_s = sys.getswitchinterval() if margin_s is None else margin_s
        self.host_factor = host_factor  # the host's planning time counts this many times
        self.clock = clock
        self._durations: dict[int, list[float]] = {}  # size class -> recent device times (s)
        self._host_s = 0.0  # recent planning + dispatch time of one step (s)
        self._queue: deque[_Queued] = deque()  # oldest first

    def dispatched(self, num_tokens: int, planning_started: float, now: float | None = None) -> None:
        """A step was planned (from `planning_started`) and dispatched (by `now`)."""
        now = self.clock() if now is None else now
        host = now - planning_started
        self._host_s = host if not self._host_s else 0.8 * self._host_s + 0.2 * host
        # with nothing ahead of it the device starts it now; else when the one ahead ends
        started = None if self._queue else now
        self._queue.append(_Queued(size_class(num_tokens), started, started, now))

    def collected(self, waited: bool, now: float | None = None) -> None:
        """The oldest step's results are back. waited: it was still running when the host came for
        them, so it ended about now."""
        if not self._queue:  # (forgotten after a failed step)
            return
        now = self.clock() if now is None else now
        step = self._queue.popleft()
        earliest, latest = step.earliest, step.latest
        recent = self._durations.setdefault(step.size, [])
        if waited:  # it ended now: the next one ran from now, or from its dispatch if that was later
            ended_from, ended_by = now, now
            if latest is not None and latest - earliest <= self.margin_s:  # its start is known
                recent.append(now - latest)
        else:  # it ended at some unseen time before now: it took at most now - earliest
            ended_from, ended_by = None, now
            if earliest is not None and recent and now - earliest < min(recent):
                recent.append(now - earliest)
        del recent[:-4]
        if self._queue:
            following = self._queue[0]
            at = following.dispatched
            following.earliest = at if ended_from is None else max(ended_from, at)
            following.latest = max(ended_by, at)

    def forget(self) -> None:
        """The steps in flight are gone (a failed step)."""
        self._queue.clear()

    def plan_at(self) -> float | None:
        """When (on the clock) to plan the next step, which will queue behind the last one
        dispatched: shortly before that one is expected to end, reckoned from the earliest it may
        have started. None: now."""
        if not self._queue:
            return None
        last = self._queue[-1]
        recent = self._durations.get(last.size)
        if last.earliest is None or not recent:
            return None
        return last.earliest + min(recent) - self.host_factor * self._host_s - self.margin_s

    def recent_durations(self, num_tokens: int) -> list[float]:
        """The device times measured for the last steps of `num_tokens`' size class (up to four,
        oldest first); the smallest is what the next one is expected to take."""
        return list(self._durations.get(size_class(num_tokens), ()))

    def expect(self, num_tokens: int, durations: list[float]) -> None:
        """Take `durations` as the recent device times of steps of `num_tokens`' size class
        (what a warm-up measured elsewhere, or a test's guess)."""
        self._durations[size_class(num_tokens)] = list(durations[-4:])


class StepWatcher:
    """A thread that runs each blocking wait handed to it (LLMEngine.in_flight_waiter: until a
    step ends on the device) and then sets `event`, so that the loop sleeping on the event plans
    the next step as soon as the one in flight ends, if that comes before its planned time."""

    def __init__(self, event: threading.Event, name: str = "jaxserve-step-watcher") -> None:
        self._event = event
        self._waits: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, wait: Callable[[], object] | None) -> None:
        """Run `wait` (None: nothing to watch): the event is set when it returns."""
        if wait is not None:
            self._waits.put(wait)

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread once the wait it is in returns (a step in flight ends on its own). Joined:
        a thread still inside the device runtime when the interpreter exits aborts the process."""
        self._waits.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (wait := self._waits.get()) is not None:
            try:
                wait()
            except Exception:  # a failed step: the engine's thread reports it when it collects it
                pass
            self._event.set()


def take_turn(engine, watcher) -> tuple[list | None, float | None]:
    """One turn of the thread that steps `engine` (an LLMEngine) for a server: step it if it is
    time, and have `watcher` (a StepWatcher) wait for the step left in flight. Returns the step's
    outputs (None: no step ran) and how long the thread may then wait for a wake-up (a request
    arriving, the watcher seeing the step in flight end): None, until woken; 0, not at all."""
    if not engine.has_unfinished_requests() or engine.is_sleeping:
        return None, None
    wait = engine.seconds_until_next_step()
    if wait > 0:  # requests that come meanwhile join the next step
        return None, wait
    outputs = engine.step()
    watcher.watch(engine.in_flight_waiter())
    return outputs, 0.0
