"""The contract between the host side (engine/) and the device side (runner/).

The Scheduler builds one SchedulerOutput per step: which sequences run, which of their
tokens are fed, where their KV pages are, and how each row that reaches the end of its
known tokens is sampled. The runner answers with a ModelRunnerOutput. Both are plain,
frozen data: neither side holds a reference into the other's state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from jaxserve.multimodal.images import ImageRows

# The arrays of a TopLogprobs: jax.Array inside the step, np.ndarray on the host.
ArrayT = TypeVar("ArrayT")

# Most token ids one row can have masked; requests needing more are refused up front.
MAX_BANNED_TOKENS = 16

# Stands in token_ids for a token sampled by the previous step and not yet back on the host.
PLACEHOLDER_TOKEN = -1


@dataclass(frozen=True)
class SamplingRow:
    """What the in-jit sampler needs for one sampled row. The same for every step of a request
    unless its processor slot, its banned tokens or its grammar's activity change, so the scheduler keeps
    one per request."""

    temperature: float  # 0.0 means greedy
    top_k: int  # 0 means off
    top_p: float
    min_p: float
    seed: int  # the request's effective seed
    # The request's prompt length, where its outputs start: the token sampled at position p (the
    # row's start_pos + num_new) is output p - output_start, an index folded into the seed's key.
    output_start: int
    banned_token_ids: tuple[int, ...] = ()  # masked out this step (see _banned_token_ids)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    processor_slot: int = -1  # the request's logit-processor slot on the device, -1 = none
    logprobs: int | None = None  # the request's `logprobs`: top-k wanted (and the sampled token's rank)
    constrained: bool = False  # structured outputs: the runner applies the row's grammar mask

    # The row's numbers in the order of FLOAT_COLUMNS and INT_COLUMNS, made once per row (a row
    # serves a request for many steps) rather than every step.
    @functools.cached_property
    def float_params(self) -> tuple[float, ...]:
        return (
            self.temperature,
            self.top_p,
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
        )

    @functools.cached_property
    def extras(self) -> tuple[bool, bool, bool]:
        """What the row needs of its step: a processor slot, top logprobs, a token mask."""
        return (self.processor_slot >= 0, self.logprobs is not None, self.constrained)

    @functools.cached_property
    def int_params(self) -> tuple[int, ...]:
        """top_k, the seed's low 32 bits, -output_start (the step adds the row's position), processor slot."""
        return (self.top_k, self.seed & 0xFFFFFFFF, -self.output_start, self.processor_slot)


# The runner's sampling arrays (layers/sampler.py SamplingArrays) built from SamplingRow's
# float_params and int_params, column by column in this order: each array's name, and what a
# row that samples nothing holds (greedy, no filter, no penalty, no processor slot).
FLOAT_COLUMNS: dict[str, float] = {
    "temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "presence": 0.0, "frequency": 0.0, "repetition": 1.0
}  # fmt: skip
INT_COLUMNS: dict[str, tuple[int, type]] = {
    "top_k": (0, np.int32), "seeds": (0, np.uint32), "steps": (0, np.int32), "processor_slot": (-1, np.int32)
}  # fmt: skip


@dataclass(frozen=True)
class LogitsSpec:
    """What a request's processor slot holds besides its token history, fixed for its life."""

    bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit); -inf: never
    allowed_token_ids: tuple[int, ...] | None = None  # None: all


@dataclass(frozen=True)
class ProcessorSlotInit:
    """Fill a request's processor slot before it samples: its bias row and token history."""

    processor_slot: int
    spec: LogitsSpec
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # non-empty when a preempted request resumes


class ScheduledSeq(NamedTuple):
    """One row of a step (a NamedTuple: hundreds are built every step)."""

    request_id: str
    token_ids: tuple[int, ...]  # [num_new] tokens fed this step, starting at position start_pos
    start_pos: int  # tokens of this sequence already in the KV cache
    block_ids: tuple[int, ...]  # the sequence's page table, covering start_pos + num_new tokens
    sampling: SamplingRow | None  # None while a prefill chunk has not reached the prompt's end
    processor_init: ProcessorSlotInit | None = None  # the first step after it got its processor slot
    # prompt_logprobs: for each fed prompt token that has a successor in the prompt, that
    # successor (the token whose logprob this row's logits give); None when not asked for.
    prompt_logprob_targets: tuple[int, ...] | None = None
    # Asynchronous scheduling: the row of the previous step whose sampled token is this row's last
    # fed token, which the host does not have yet (token_ids holds PLACEHOLDER_TOKEN there; the
    # runner feeds the token from the previous step's device output). -1: every token is known.
    feed_from_row: int = -1
    lora_slot: int = -1  # the device LoRA slot of the request's adapter; -1: the base model
    # Speculative decoding: the last num_drafts of token_ids are proposed, not known, tokens. The
    # row samples at its last num_drafts + 1 tokens and keeps the samples up to the first one
    # that differs from the proposal after it (ModelRunnerOutput.num_sampled).
    num_drafts: int = 0
    # A prompt given as embeddings: float32 [rows, hidden] fed in place of the embedding table's
    # rows at the first rows of token_ids (their ids are placeholders); or (offsets into token_ids,
    # [rows, hidden] float32) at those tokens (an image's rows, runner/image_encoder.py); None for
    # every other row.
    prompt_embeds: np.ndarray | tuple[np.ndarray, np.ndarray] | None = None
    # A prompt's image rows among this row's tokens (jaxserve/multimodal/images.py): the runner
    # encodes the images and feeds their rows like prompt embeddings; None for every other row.
    images: ImageRows | None = None
    # M-RoPE models: the (time, height, width) positions of token_ids ([3, num_new] int32) when the
    # request's prompt holds images; None: each token's sequence position three times
    rope_positions: np.ndarray | None = None

    @property
    def num_new(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SwapOps:
    """The copies one step asks the runner for, before it runs: (request id, page ids) out to host
    memory, then (request id, page ids) back in; and host copies no longer needed (ids)."""

    out: tuple[tuple[str, tuple[int, ...]], ...] = ()
    into: tuple[tuple[str, tuple[int, ...]], ...] = ()
    drop: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.out or self.into or self.drop)


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...]  # rows with new tokens, in the order the runner lays them out
    # (slot, LoRARequest): adapters to write into their device slots before this step runs
    lora_loads: tuple[tuple[int, Any], ...] = ()
    # swap preemption: KV pages to copy out to host memory and back in before the step runs
    swap: SwapOps | None = None

    @functools.cached_property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class TopLogprobs(NamedTuple, Generic[ArrayT]):
    """Ranked logprobs: per row, the top-k candidates and one chosen token (the sampled one, or
    the prompt token whose logprob was asked for).

    One type on both sides of the contract: the sampler builds it from jax arrays inside the
    step, and the same value, copied to the host, holds numpy arrays. A NamedTuple is a pytree
    to JAX without registering it, so this module (imported by the host side, which never
    imports jax) stays free of jax."""

    ids: ArrayT  # [rows, k] int32, most likely first
    logprobs: ArrayT  # [rows, k] float32
    chosen_logprobs: ArrayT  # [rows] float32
    chosen_ranks: ArrayT  # [rows] int32, 1 + how many tokens are strictly more likely than the chosen one

    def take(self, rows) -> TopLogprobs[ArrayT]:
        """The same fields at `rows` (an index, a slice or an index array): the host picks out
        the rows of sampled requests, and of each request's prompt tokens."""
        return TopLogprobs(*(x[rows] for x in self))


@dataclass(frozen=True)
class ModelRunnerOutput:
    """A step's tokens: each request that sampled gets one or more (several where it was fed
    proposed tokens), back to back in req_ids' order, with one logprob (and ranked row) each."""

    req_ids: tuple[str, ...]  # requests that sampled a token this step, in SchedulerOutput order
    sampled_token_ids: np.ndarray  # [total tokens] int32
    logprobs: np.ndarray  # [total tokens] float32, log-probability of each sampled token
    top_logprobs: TopLogprobs[np.ndarray] | None = (
        None  # rows as the tokens, when some row asked for logprobs
    )
    # request id -> the ranked logprobs of the prompt_logprob_targets fed this step
    prompt_logprobs: dict[str, TopLogprobs[np.ndarray]] = field(default_factory=dict)
    # [len(req_ids)] int32: tokens of each request, >= 1; None: one each (no row had proposals)
    num_sampled: np.ndarray | None = None
    # A pooling model's step (nothing sampled): [len(seqs), 3, hidden] float32, per scheduled row
    # the sum of its fed tokens' final hidden states, the first one's and the last one's
    pooled: np.ndarray | None = None
    # ALL and STEP pooling: [num_tokens, hidden or labels] float32, every fed token's final hidden
    # state through the model's pooler head, rows back to back
    pooled_tokens: np.ndarray | None = None

    @classmethod
    def of_pooling(cls, pooled: np.ndarray, pooled_tokens: np.ndarray | None) -> ModelRunnerOutput:
        """A pooling model's step: its rows' sums (and tokens' rows), nothing sampled."""
        none = np.zeros(0, np.int32)
        return cls((), none, none.astype(np.float32), pooled=pooled, pooled_tokens=pooled_tokens)


@runtime_checkable
class StepRunner(Protocol):
    """What the engine asks of its device side each step (ModelRunner; tests' fake runners
    answer the same, checked by one conformance test). A step is dispatched, may be waited on
    without reading it, and is collected once, in dispatch order."""

    args: Any  # the model's shape (vocab_size: the width of the logits)
    num_blocks: int  # pages in the KV pool, the null page included
    ready_token_budget: int | None  # most tokens a step may have while buckets compile; None: no cap
    kv_pool_lost: bool  # a failed step took the KV pool with it (reset_kv_pool rebuilds it)

    def dispatch(self, sched: SchedulerOutput, fill_bitmask=None) -> Any:
        """Start the step on the device; a handle for the calls below."""

    def is_ready(self, handle: Any) -> bool:
        """Whether the step has ended on the device (collect would not wait)."""

    def wait_ready(self, handle: Any) -> None:
        """Block until the step has ended on the device, without reading its results."""

    def collect(self, handle: Any) -> ModelRunnerOutput:
        """The step's results on the host (waits for it to end)."""

    def reset_kv_pool(self) -> None:
        """A fresh KV pool after a failed step lost it."""
