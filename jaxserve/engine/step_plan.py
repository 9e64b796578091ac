"""The Scheduler's step in the making and in flight: the rows planned so far, what admitting a
waiting request came to, and a scheduled step whose tokens are not back yet."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from jaxserve.engine.request import Request
from jaxserve.scheduler_output import SchedulerOutput


class InFlightStep(NamedTuple):
    """A step scheduled and not yet updated."""

    sched: SchedulerOutput
    sampled: tuple[Request, ...]  # the requests whose rows sample, in the order of the output's rows


@dataclass
class StepPlan:
    """A step being planned: its requests in the order their rows are laid out, the tokens each
    is fed, and the token budget left."""

    budget: int
    requests: list[Request] = field(default_factory=list)
    num_tokens: dict[str, int] = field(default_factory=dict)  # by request id
    preempted: bool = False  # some request lost its pages

    def add(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_tokens[req.request_id] = n
        self.budget -= n

    def drop(self, req: Request) -> None:
        """Take a preempted request's row back, with its tokens."""
        n = self.num_tokens.pop(req.request_id, None)
        if n is not None:
            self.requests.remove(req)
            self.budget += n


class Admission(enum.Enum):
    ADMITTED = enum.auto()  # started: the next waiting request moves up to this index
    SKIP = enum.auto()  # waits for now; the ones behind it may start
    STOP = enum.auto()  # nothing more starts this step
