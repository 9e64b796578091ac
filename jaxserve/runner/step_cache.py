"""Compiled steps held in memory, shared by the runners it is handed to.

Where it sits: ModelRunner._compile asks here before it loads a step from the executable store
(executable_cache.py, on disk) or traces and compiles one. A runner makes its own when given
none. Handing one StepCache to several runners of the same model and shapes (several LLM
objects in a notebook, a test suite's engines) lets every runner after the first compile
nothing; a runner of another model, or on other shapes or devices, finds other keys and
shares nothing. Sharing is explicit: whoever builds the runners decides which ones share.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable

import jax


class StepCache:
    """Compiled steps by key, the least recently used dropped past `max_steps`."""

    def __init__(self, max_steps: int = 256):
        self.max_steps = max_steps
        self._steps: collections.OrderedDict[Hashable, jax.stages.Compiled] = collections.OrderedDict()
        # A runner's start-up compiles in a background thread while its engine compiles the
        # variants a batch needs; runners sharing the cache may run on threads of their own.
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0  # steps built (compiled, or loaded from disk) because none was held

    def get_or_build(self, key: Hashable, build: Callable[[], jax.stages.Compiled]) -> jax.stages.Compiled:
        """The step held under `key`, else `build()`'s, kept. The build runs outside the lock, so
        a long compile never holds up another key; two threads missing the same key at once both
        build it, and the second one's is kept."""
        with self._lock:
            compiled = self._steps.get(key)
            if compiled is not None:
                self._steps.move_to_end(key)
                self.hits += 1
                return compiled
        compiled = build()
        with self._lock:
            self.misses += 1
            self._steps[key] = compiled
            self._steps.move_to_end(key)
            while len(self._steps) > self.max_steps:
                self._steps.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._steps)

    def clear(self) -> None:
        with self._lock:
            self._steps.clear()
