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


class PlannedRow(NamedTuple):
    request: Request
    num_tokens: int  # fed this step


@dataclass
class StepPlan:
    """A step being planned: its rows so far, in the order they are laid out, and the token
    budget left."""

    budget: int
    rows: dict[str, PlannedRow] = field(default_factory=dict)  # by request id
    preempted: bool = False  # some request lost its pages

    def add(self, req: Request, n: int) -> None:
        self.rows[req.request_id] = PlannedRow(req, n)
        self.budget -= n

    def drop(self, req: Request) -> None:
        """Take a preempted request's row back, with its tokens."""
        row = self.rows.pop(req.request_id, None)
        if row is not None:
            self.budget += row.num_tokens


class Admission(enum.Enum):
    ADMITTED = enum.auto()  # started: the next waiting request moves up to this index
    SKIP = enum.auto()  # waits for now; the ones behind it may start
    STOP = enum.auto()  # nothing more starts this step
