"""The step buckets compiled at start-up: those a first request needs now, the rest on a
background thread, and which are ready so far.

The engine plans each step within `ready` (its token budget follows the largest ready bucket), so
no request waits on or triggers a compile while the rest build; the offline LLM waits for all of
them first, and a server's shutdown stops the thread between two buckets.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable

import jax
from tqdm.auto import tqdm

from jaxserve.runner.bucketing import Buckets

logger = logging.getLogger(__name__)

# Compiles whose background thread may still run. At exit each finishes the bucket it is on and
# stops: a daemon thread killed inside XLA's compiler aborts the process, and waiting for every
# remaining bucket would hold an exit (after a failed bind, say) for most of a minute.
_RUNNING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    for compiles in list(_RUNNING):
        compiles.stop()


class BucketCompiles:
    """`compile_bucket(bucket)` for every bucket of `buckets`, first ones now, the rest behind."""

    def __init__(self, buckets: Buckets, compile_bucket: Callable[[tuple[int, int]], object]):
        self.buckets = buckets
        self._compile_bucket = compile_bucket
        # The buckets a step may use: all of them when compiled on demand (enforce_eager), else
        # the ones compiled so far (start() widens it as the background compiles finish).
        self.ready = buckets
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        """Compile the buckets a first request needs now and the rest in a background thread
        (Buckets.startup_order). Several processes must run the same programs step by step, so
        they compile everything first."""
        start = time.perf_counter()
        first, rest = self.buckets.startup_order()
        if jax.process_count() > 1:
            first, rest = first + rest, []
        buckets = [b for t in first for b in self.buckets.of_tokens(t)]
        for bucket in tqdm(buckets, desc="Compiling step buckets", disable=None):
            self._compile_bucket(bucket)
        self.ready = self.buckets.subset(first)
        logger.info(
            "Compiled %d step buckets in %.1f s; %d more compile in the background",
            len(buckets), time.perf_counter() - start, len(self.buckets.all()) - len(buckets),
        )  # fmt: skip
        if rest:
            self._thread = threading.Thread(
                target=self.compile_rest, args=(first, rest, start), name="jaxserve-compile", daemon=True
            )
            _RUNNING.add(self)
            self._thread.start()

    def compile_rest(self, ready: list[int], rest: list[int], start: float) -> None:
        """The background thread's work: the token buckets of `rest` in order, each made ready
        as soon as it is compiled, until done or stopped."""
        try:
            for token_bucket in rest:
                if self._stopping.is_set():
                    return
                for bucket in self.buckets.of_tokens(token_bucket):
                    self._compile_bucket(bucket)
                ready = [*ready, token_bucket]
                self.ready = self.buckets.subset(ready)  # one assignment: the engine sees all or none
            logger.info(
                "All %d step buckets compiled, %.1f s after start-up began",
                len(self.buckets.all()), time.perf_counter() - start,
            )  # fmt: skip
        except BaseException as err:  # the engine goes on with the buckets it has
            if self._stopping.is_set():
                return  # shutting down: JAX may already be tearing down what a lowering uses
            self._error = err
            logger.exception("Compiling the remaining step buckets failed; serving with %s", ready)

    def stop(self, wait: bool = True) -> None:
        """Let the background compile finish the bucket it is on and stop (server shutdown);
        wait=False: ask it to, and return at once."""
        self._stopping.set()
        if wait and self._thread is not None:
            self._thread.join()

    def wait(self) -> None:
        """Block until every bucket is compiled (the offline LLM wants them all before it runs)."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"compiling the step buckets failed: {self._error}") from self._error
