"""Swap preemption's bookkeeping (`--preemption-mode swap`, `--swap-space` GiB): which preempted
requests keep their KV in host memory instead of recomputing it, and the copies the runner is
to make before the next step runs.

A request swapped out gives its pages back at once; the runner copies them to host memory, in one
gathered copy of every layer's pages, before the step that may reuse them writes anything (steps
and copies run in order on the device). When the request is admitted again it gets new pages, the
runner copies its KV into them, and it goes on from where it stopped. A request is swapped only
when its pages fit what is left of the swap space and it has at least SWAP_MIN_TOKENS computed
tokens (a short context costs less to recompute than to copy out and back);
any other preemption recomputes. The Scheduler owns this object (DESIGN.md, "Who may touch what").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.scheduler_output import SwapOps

# Fewer computed tokens than this: recompute instead (a prompt step of that many tokens is about
# as cheap as two copies of their pages).
SWAP_MIN_TOKENS = 256


@dataclass
class SwapSpace:
    num_blocks: int  # host pages the swap space holds
    bytes_per_block: int  # one page of every layer
    min_tokens: int = SWAP_MIN_TOKENS
    swapped: dict[str, int] = field(default_factory=dict)  # request id -> its pages in host memory
    num_swap_outs: int = 0  # cumulative: requests swapped out
    bytes_out: int = 0  # cumulative: bytes copied to host memory
    _out: list = field(default_factory=list)
    _into: list = field(default_factory=list)
    _drop: list = field(default_factory=list)

    @classmethod
    def of(cls, config, runner) -> SwapSpace | None:
        """With swap preemption (an EngineConfig's), swap_space GiB of whole pages of the runner's
        pool (every layer's); else None."""
        if config.scheduler_config.preemption_mode != "swap":
            return None
        block_bytes = runner.kv_spec.bytes_per_block
        return cls(int(config.cache_config.swap_space * (1 << 30)) // block_bytes, block_bytes)

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - sum(self.swapped.values())

    def swap_out(
        self, req_id: str, num_computed_tokens: int, block_size: int, table: tuple[int, ...]
    ) -> bool:
        """Keep a preempted request's KV (the pages of its computed tokens) in host memory, if it
        is worth it and fits; False: it recomputes."""
        pages = -(-num_computed_tokens // block_size)
        if num_computed_tokens < self.min_tokens or pages > self.free_blocks or pages > len(table):
            return False
        self.swapped[req_id] = pages
        self._out.append((req_id, tuple(table[:pages])))
        self.num_swap_outs += 1
        self.bytes_out += pages * self.bytes_per_block
        return True

    def swap_in(self, req_id: str, table: tuple[int, ...]) -> None:
        """The request is admitted again with `table`: its KV goes back into its first pages."""
        pages = self.swapped.pop(req_id)
        self._into.append((req_id, tuple(table[:pages])))

    def drop(self, req_id: str) -> None:
        """The request ended while swapped out: its host copy is not needed."""
        if self.swapped.pop(req_id, None) is not None:
            self._drop.append(req_id)

    def take(self) -> SwapOps:
        """The copies pending since the last step that ran, for the step being committed."""
        ops = SwapOps(tuple(self._out), tuple(self._into), tuple(self._drop))
        self._out, self._into, self._drop = [], [], []
        return ops
