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
then, which lowers a longer guess. (Without a watcher the loop asks every POLL_S instead: on a
machine whose cores also run the step, those wake-ups slow the step itself.)
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable


def size_class(num_tokens: int) -> int:
    """Steps of similar cost: their token count rounded up to a power of two."""
    return 1 << max(num_tokens - 1, 0).bit_length()


class StepPacer:
    POLL_S = 0.002  # without a StepWatcher: the longest the loop waits before asking again

    def __init__(self, margin_s: float | None = None, host_factor: float = 2.0) -> None:
        # kept free before the expected end besides the host's own time; by default Python's
        # thread switch interval, the longest the waiting thread may wait for the interpreter
        # while another thread of the server (streaming outputs) holds it
        self.margin_s = sys.getswitchinterval() if margin_s is None else margin_s
        self.host_factor = host_factor  # the host's planning time counts this many times
        self._durations: dict[int, list[float]] = {}  # size class -> recent device times (s)
        self._host_s = 0.0  # recent planning + dispatch time of one step (s)
        # steps dispatched and not collected, oldest first: [size class, earliest and latest time
        # it may have started on the device (None: not known yet), when it was dispatched]
        self._queue: deque[list] = deque()

    def dispatched(self, num_tokens: int, planning_started: float, now: float | None = None) -> None:
        """A step was planned (from `planning_started`) and dispatched (by `now`)."""
        now = time.perf_counter() if now is None else now
        host = now - planning_started
        self._host_s = host if not self._host_s else 0.8 * self._host_s + 0.2 * host
        # with nothing ahead of it the device starts it now; else when the one ahead ends
        started = None if self._queue else now
        self._queue.append([size_class(num_tokens), started, started, now])

    def collected(self, waited: bool, now: float | None = None) -> None:
        """The oldest step's results are back. waited: it was still running when the host came for
        them, so it ended about now."""
        if not self._queue:  # (forgotten after a failed step)
            return
        now = time.perf_counter() if now is None else now
        size, earliest, latest, _ = self._queue.popleft()
        recent = self._durations.setdefault(size, [])
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
            following[1] = following[3] if ended_from is None else max(ended_from, following[3])
            following[2] = max(ended_by, following[3])

    def forget(self) -> None:
        """The steps in flight are gone (a failed step)."""
        self._queue.clear()

    def plan_at(self) -> float | None:
        """When (time.perf_counter) to plan the next step, which will queue behind the last one
        dispatched: shortly before that one is expected to end, reckoned from the earliest it may
        have started. None: now."""
        if not self._queue:
            return None
        size, earliest, _, _ = self._queue[-1]
        recent = self._durations.get(size)
        if earliest is None or not recent:
            return None
        return earliest + min(recent) - self.host_factor * self._host_s - self.margin_s


class StepWatcher:
    """A thread that runs each blocking wait handed to it (LLMEngine.in_flight_waiter: until a
    step ends on the device) and then sets `event`, so that the loop sleeping on the event plans
    the next step as soon as the one in flight ends, if that comes before its planned time."""

    def __init__(self, event: threading.Event, name: str = "jaxserve-step-watcher") -> None:
        self._event = event
        self._waits: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, wait: Callable[[], object] | None) -> bool:
        """Run `wait` (None: nothing to watch); whether the event will be set when it returns."""
        if wait is not None:
            self._waits.put(wait)
        return wait is not None

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
