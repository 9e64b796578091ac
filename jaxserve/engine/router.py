"""Which data-parallel replica serves a request (`-dp N`).

Where it sits: inside AsyncLLMEngine, on the event loop. Each replica is a whole engine on
its own group of devices with its own KV pool and prefix cache, so a request should go
where its prompt's pages are already cached, unless that replica is much busier than the
others. The router never reads a replica's scheduler (only the replica's own thread does):
it keeps its own record of the prompt pages it sent to each replica, a bounded LRU of
chained page hashes (the block manager's `page_hashes`, so equal hashes mean equal
prefixes), and counts the requests each replica has not finished yet.

The rule: among the replicas whose load is within `slack` requests of the least loaded,
take the one holding the longest prefix of the prompt; ties go to the fewer requests, then
to the emptier KV cache (the replicas' last published usage).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from jaxserve.engine.block_manager import page_hashes


class Router:
    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int, slack: int):
        self.block_size = block_size
        self.capacity = capacity_blocks  # page hashes remembered per replica (its pool's size)
        self.slack = slack
        self.loads = [0] * num_replicas  # unfinished requests routed to each replica
        self.kv_usage = [0.0] * num_replicas
        self._pages: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def cached_pages(self, replica: int, token_ids: Sequence[int]) -> int:
        """Leading full pages of the prompt sent to this replica before (as far as the router knows)."""
        return self._prefix_len(replica, page_hashes(token_ids, self.block_size))

    def _prefix_len(self, replica: int, hashes: list[int]) -> int:
        pages, n = self._pages[replica], 0
        while n < len(hashes) and hashes[n] in pages:
            n += 1
        return n

    def assign(self, token_ids: Sequence[int]) -> int:
        least = min(self.loads)
        near = [i for i, load in enumerate(self.loads) if load <= least + self.slack]
        hashes = page_hashes(token_ids, self.block_size)
        best = max(near, key=lambda i: (self._prefix_len(i, hashes), -self.loads[i], -self.kv_usage[i], -i))
        self.loads[best] += 1
        pages = self._pages[best]
        # Most recently used last, and a prompt's first page the most recent of its pages:
        # past capacity the oldest fall out, deepest pages first, so prefixes stay whole.
        for h in reversed(hashes):
            pages[h] = None
            pages.move_to_end(h)
        while len(pages) > self.capacity:
            pages.popitem(last=False)
        return best

    def release(self, replica: int) -> None:
        self.loads[replica] -= 1
