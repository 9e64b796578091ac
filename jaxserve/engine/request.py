"""A request as the host side of the engine sees it.

Created by LLMEngine.add_request, mutated only by the Scheduler (queues, computed tokens,
output tokens, status) and read by everyone else. Never imported by the runner.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from jaxserve.pooling_params import PooledSums, PoolingParams
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler_output import LogitsSpec, TopLogprobs

if TYPE_CHECKING:
    from jaxserve.multimodal.images import RequestImages


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED  # the strings: an enum member hashes in Python

    @property
    def finish_reason(self) -> str | None:
        """vLLM's finish_reason string, or None while the request is alive."""
        return self.value if self.finished else None


_FINISHED = frozenset(("stop", "length", "abort", "error"))


class Request:
    # A pooling request (neutral sampling_params, never sampled; it ends with its prompt's last
    # chunk) has its PoolingParams, resolved by the InputProcessor, and its chunks' sums so far.
    pooling_params: PoolingParams | None = None
    pooled: PooledSums | None = None
    # A prompt given as embeddings: float32 [num_prompt_tokens, hidden] fed in place of the
    # embedding table's rows (its prompt_token_ids are placeholders, 0), and the sha256 of their
    # bytes (the root of its prefix-cache chain); None for a prompt of tokens.
    prompt_embeds = None
    embeds_digest: bytes | None = None
    # A prompt with images: where their rows go (its embeds_digest is the images' digest).
    images: RequestImages | None = None

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        seed: int,
        eos_token_id: int | None = None,
        prompt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        max_tokens: int,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("The prompt must contain at least one token.")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)  # (the prompt never changes)
        self.sampling_params = sampling_params
        self.seed = seed  # effective sampling seed: the request's own, or one the engine drew
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.max_tokens = max_tokens  # resolved: the request's max_tokens capped by model length
        # Output tokens at which it ends on length (the scheduler lowers it to fit max_model_len)
        # and the tokens that may stop it: what the scheduler checks first for every new token.
        self.output_limit = max_tokens
        self.stop_ids = frozenset(sampling_params.stop_token_ids) | (
            {eos_token_id} if eos_token_id is not None and not sampling_params.ignore_eos else set()
        )
        self.output_token_ids: list[int] = []
        self.cumulative_logprob = 0.0
        self.num_computed_tokens = 0
        # Tokens sampled by a step still in flight (asynchronous scheduling: 0 or 1), which the
        # next step is fed on the device before the host has them.
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache on first schedule
        self.scheduled_time: float | None = None  # when it was first scheduled (the engine's clock)
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING  # sets is_finished too
        self.stop_reason: int | str | None = None
        self.first_token_time: float | None = None
        # Logit processing on the device: the processor slot's fixed contents (None: needs
        # none), and the slot while the request runs.
        self.logits_spec: LogitsSpec | None = None
        self.processor_slot = -1
        self.sampling_row = None  # its last scheduler_output.SamplingRow, reused while unchanged
        self.bad_words: tuple[tuple[int, ...], ...] = ()  # multi-token bad words, as token ids
        # Structured outputs: the sequence's place in its grammar (structured_output.RequestGrammar)
        self.grammar = None
        self.wants_prompt_logprobs = False
        self.shares_prompt_with: Request | None = None  # the first sample of the same prompt (n > 1)
        self.output_logprobs: list[TopLogprobs] = []  # one ranked row per output token
        self.prompt_logprobs: list[TopLogprobs] = []  # row k: the logprob of prompt token k + 1
        self.lora_request = None  # a lora.request.LoRARequest: served with that adapter
        self.lora_slot = -1  # its device slot while the request runs
        self.draft_token_ids: tuple[int, ...] = ()  # proposed to follow its last token (speculative decoding)
        self.num_new_tokens = 0  # output tokens the last update() added (a step may add several)
        self.new_logprobs: list[float] = []  # their logprobs, when a step with proposals added them

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished_on_stop_token(self) -> bool:
        """Stopped by its last token being eos or a stop token id (whose text is not output);
        a request whose grammar completed stops on a token that is part of its text."""
        if self.status != RequestStatus.FINISHED_STOPPED or not self.output_token_ids:
            return False
        last = self.output_token_ids[-1]
        return last == self.eos_token_id or last in self.sampling_params.stop_token_ids

    @property
    def status(self) -> RequestStatus:
        return self._status

    @status.setter
    def status(self, status: RequestStatus) -> None:
        self._status = status
        self.is_finished = status.finished  # read for every row of every step: a plain attribute

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, {self.status.name})"
        )
