"""ParentRequest: one user request as the engine's front and back see it.

The InputProcessor builds it (prompt, n child sequences that share the prompt's pages), the
Scheduler runs its children as independent Requests, and the OutputProcessor keeps on it what
turns tokens into outputs: a detokenizer per child and the logprob dicts built so far.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.request import Request
from jaxserve.sampling_params import RequestOutputKind


@dataclass
class ParentRequest:
    """A user request: the prompt and its child sequences (best_of of them, n reported)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer | None] = field(default_factory=list)
    # Logprob dicts already built, per child and for the prompt (built once, as rows arrive).
    logprob_dicts: list[list[dict]] = field(default_factory=list)
    prompt_logprob_dicts: list[dict] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    n: int = 1  # samples to return
    best_of: int = 1  # samples to run (the n of highest cumulative logprob are returned)
    trace_headers: Mapping[str, str] | None = None  # W3C trace context it came with (engine/tracing.py)
    # output_kind DELTA: per child, the output tokens already reported; whether the prompt's were
    reported: list[int] = field(default_factory=list)
    prompt_reported: bool = False
    from_embeds: bool = False  # the prompt came as embeddings: its token ids are placeholders

    @cached_property  # asked every step; fixed once the children exist
    def reports_progress(self) -> bool:
        """Outputs while it runs: cumulative or delta outputs asked for, and no best-of-n choice
        pending."""
        params = self.children[0].sampling_params
        return self.best_of == self.n and params.output_kind != RequestOutputKind.FINAL_ONLY

    @cached_property
    def reports_deltas(self) -> bool:
        return self.children[0].sampling_params.output_kind == RequestOutputKind.DELTA

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)
