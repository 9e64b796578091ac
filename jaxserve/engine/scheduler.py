"""Continuous batching: decides, every step, which requests run and how many tokens each.

Sits between LLMEngine.add_request and the runner: schedule() builds the SchedulerOutput
for one step, update() takes the ModelRunnerOutput back, appends the sampled tokens and
finishes requests. It is the sole writer of Request state and the only caller of the
BlockManager.

As in vLLM v1 there are no separate prefill and decode phases: a request has
num_computed_tokens (tokens whose KV is in the cache) and every step it is fed the next
tokens of prompt + output it has not computed yet. A decode is a chunk of one token; a
prefill is a chunk of many; both share one step and one token budget. num_computed_tokens
advances at schedule time, so the next step can be planned before this one's tokens are
back.

Asynchronous scheduling plans step N+1 while step N runs: a request whose token step N is
sampling has one output placeholder (Request.num_output_placeholders), and its row in step N+1
feeds that token from step N's device output (ScheduledSeq.feed_from_row). update() fills the
placeholder when the token comes back. A request that the pending token will end on length is
not scheduled again; one that ends on EOS, a stop token or a stop string has run one row too many,
whose token is dropped.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.block_manager import BlockManager, PrefixCacheStats
from jaxserve.engine.lora_slots import LoRASlots
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.scheduler_output import (
    PLACEHOLDER_TOKEN,
    ModelRunnerOutput,
    SamplingRow,
    ScheduledSeq,
    SchedulerOutput,
    SlotInit,
    TopLogprobs,
)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        num_lora_slots: int = 0,
    ) -> None:
        if scheduler_config.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {scheduler_config.policy!r}.")
        if scheduler_config.preemption_mode != "recompute":
            raise ValueError("Only preemption_mode='recompute' is supported.")
        self.config = scheduler_config
        self.block_manager = BlockManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            cache_config.prefix_caching_hash_algo,
        )
        self.requests: dict[str, Request] = {}  # live (unfinished) requests by id
        # fcfs: arrival order, preempted requests in front. priority: sorted by
        # (priority, arrival_time), preempted requests re-inserted by the same key.
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in scheduling order; the tail is preempted first
        # Steps scheduled and not yet updated: id -> (the step, its sampling requests in row order)
        self._unreported: dict[int, tuple[SchedulerOutput, tuple[Request, ...]]] = {}
        self._sampled_rows: dict[str, int] = {}  # request id -> its sampled row in the last step
        self.num_preemptions = 0
        # long_prefill_token_threshold, where it applies (chunked prefill on); 0: no cap
        self._chunk_cap = (
            scheduler_config.long_prefill_token_threshold if scheduler_config.enable_chunked_prefill else 0
        )
        # Device slots for per-request logit processing (penalties, bias): one per running
        # request at most, so max_num_seqs of them never run out.
        self._free_slots = list(range(scheduler_config.max_num_seqs - 1, -1, -1))
        self.lora_slots = LoRASlots(num_lora_slots) if num_lora_slots else None
        # scheduler_delay_factor: how long the last step that started prompts took
        self.clock = time.monotonic  # the clock of requests' arrival times
        self._prompts_started_at: float | None = None
        self._prompt_step_s = 0.0

    # ---- queues --------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def lora_adapters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The LoRA adapters' names (each once, in queue order) of the running and the waiting
        requests."""

        def names(queue: list[Request]) -> tuple[str, ...]:
            return tuple(dict.fromkeys(r.lora_request.lora_name for r in queue if r.lora_request is not None))

        return names(self.running), names(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.block_manager.stats

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        """Queue a request; raise ValueError for one that could never be scheduled, rather
        than letting it wait (and block the queue behind it) forever."""
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        # The last sampled token is never fed, so its KV never needs a page.
        max_kv_tokens = min(request.num_prompt_tokens + request.max_tokens - 1, self.config.max_model_len)
        bm = self.block_manager
        if bm.num_blocks_for(max_kv_tokens) > bm.num_usable_blocks:
            raise ValueError(
                f"Request {request.request_id!r} needs up to {max_kv_tokens} tokens of KV cache but the "
                f"pool holds only {bm.num_usable_blocks * bm.block_size}."
            )
        if not self.config.enable_chunked_prefill and max_kv_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"Request {request.request_id!r} may need a prefill of {max_kv_tokens} tokens, more than "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens}, and chunked prefill is off."
            )
        request.status = RequestStatus.WAITING
        request.output_limit = min(request.max_tokens, self.config.max_model_len - request.num_prompt_tokens)
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def _push_waiting(self, request: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            bisect.insort(self.waiting, request, key=_priority_key)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    # ---- schedule ------------------------------------------------------------------------

    def schedule(self, max_tokens: int | None = None) -> SchedulerOutput:
        """max_tokens: a lower token budget for this step (the runner's largest compiled shape
        while the rest still compile at start-up)."""
        budget = min(self.config.max_num_batched_tokens, max_tokens or self.config.max_num_batched_tokens)
        num_new: dict[str, int] = {}  # request id -> tokens scheduled this step
        scheduled: list[Request] = []  # in the order the rows are laid out
        preempted = False

        # 1. Running requests, in order: decodes and the next chunks of ongoing prefills.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk_size(req, req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not self.block_manager.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self._pick_victim()
                preempted = True
                if victim.request_id in num_new:
                    # Already scheduled this step (possible under the priority policy):
                    # give back its tokens and its row.
                    budget += num_new.pop(victim.request_id)
                    scheduled.remove(victim)
                self._preempt(victim)
                if victim is req:
                    break
                i = self.running.index(req)  # the victim may have stood before req
            else:
                scheduled.append(req)
                num_new[req.request_id] = n
                budget -= n
                i += 1
                continue
            break  # the request preempted itself: nothing below it can get pages either

        # 2. Waiting requests, unless this step had to preempt: pages are short, and the
        # preempted requests must not be readmitted ahead of the running ones.
        now = self.clock()
        admitting = self._prompts_may_start(now)
        w = 0
        while (
            admitting
            and not preempted
            and w < len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[w]
            if self._waits_for_prompt_pages(req) or req.num_output_placeholders:
                # a sibling sample: admitted once the first one has its prompt in pages; a
                # preempted request: once the token of the step in flight is back
                w += 1
                continue
            first_time = req.status == RequestStatus.WAITING
            token_ids = req.all_token_ids
            root = self._cache_root(req)
            if req.wants_prompt_logprobs:  # every prompt token must run to give its logprobs
                computed_blocks, num_cached = [], 0
            else:
                computed_blocks, num_cached = self.block_manager.get_computed_blocks(token_ids, root)
            n = self._chunk_size(req, num_cached, budget)
            if not self.config.enable_chunked_prefill and num_cached + n < req.num_tokens:
                break  # the whole prompt must fit; keep strict order rather than skip it
            if req.lora_request is not None:
                req.lora_slot = self.lora_slots.acquire(req.lora_request)
                if req.lora_slot is None:  # every slot is pinned by other adapters: it waits
                    req.lora_slot = -1
                    w += 1
                    continue
            if not self.block_manager.allocate(req.request_id, num_cached + n, computed_blocks):
                self._free_slot(req)
                break
            self.waiting.pop(w)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if first_time:
                req.num_cached_tokens = num_cached
                req.scheduled_time = now
                if self.block_manager.enable_prefix_caching:
                    self.block_manager.stats.record(req.num_tokens, num_cached)
            self.running.append(req)
            scheduled.append(req)
            num_new[req.request_id] = n
            budget -= n
            self._prompts_started_at = now

        last_rows, self._sampled_rows = self._sampled_rows, {}
        sampled: list[Request] = []  # _commit adds the requests whose row samples, in row order
        sched = SchedulerOutput(
            seqs=tuple(
                [
                    self._commit(req, num_new[req.request_id], row, last_rows, sampled)
                    for row, req in enumerate(scheduled)
                ]
            ),
            lora_loads=self.lora_slots.take_loads() if self.lora_slots is not None else (),
        )
        if scheduled:
            self._unreported[id(sched)] = (sched, tuple(sampled))
        return sched

    def _prompts_may_start(self, now: float) -> bool:
        """scheduler_delay_factor: while requests run, waiting ones start only once the oldest
        has waited delay_factor times the last prompt step's length (the time from the step that
        last started prompts to the step after), so that more prompts share one step."""
        if self._prompts_started_at is not None:
            self._prompt_step_s, self._prompts_started_at = now - self._prompts_started_at, None
        if self.config.delay_factor <= 0 or not self.running or not self.waiting:
            return True
        oldest = min(r.arrival_time for r in self.waiting)
        return now - oldest > self.config.delay_factor * self._prompt_step_s

    def needs_tokens_before_next(self, sched: SchedulerOutput) -> bool:
        """Whether the next step can only be planned once this one's tokens are back: a row's
        grammar or bad words depend on the token it samples."""
        entry = self._unreported.get(id(sched))
        return entry is not None and any(r.grammar is not None or r.bad_words for r in entry[1])

    def forget(self, sched: SchedulerOutput) -> None:
        """A step that never ran (its requests are failed): no update() will come for it."""
        self._unreported.pop(id(sched), None)

    def _waits_for_prompt_pages(self, req: Request) -> bool:
        """Samples 2..n of one request share the first one's prompt pages through the prefix
        cache: they wait until its prompt is computed, then take every full page from the
        cache and compute only the last, partial page themselves (their first divergent
        page: copy on write, by recomputing a page's worth of tokens at most)."""
        first = req.shares_prompt_with
        if first is None or not self.block_manager.enable_prefix_caching:
            return False
        alive = first.request_id in self.requests
        return alive and first.num_computed_tokens < first.num_prompt_tokens - 1

    def _chunk_size(self, req: Request, num_computed: int, budget: int) -> int:
        n = self._target_tokens(req) - num_computed
        if n > 1 and self._chunk_cap:
            n = min(n, self._chunk_cap)  # leave budget for other prefills in the same step
        return min(n, budget)

    def _target_tokens(self, req: Request) -> int:
        """The tokens whose KV the request needs before its next sample: all it has, and the one a
        step in flight is sampling for it, unless that token will end it on length anyway."""
        known = req.num_prompt_tokens + len(req.output_token_ids)
        pending = req.num_output_placeholders
        if pending and known + pending - req.num_prompt_tokens < req.output_limit:
            return known + pending
        return known

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt(self, req: Request, counted: bool = True) -> None:
        """Preemption by recompute: drop the KV, keep the tokens; the request's prompt and
        outputs so far are prefilled again when it is readmitted (mostly from the prefix
        cache, if its pages have not been evicted by then)."""
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        self._free_slot(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        if counted:
            req.num_preemptions += 1
            self.num_preemptions += 1
        self._push_waiting(req, front=True)

    def _commit(
        self, req: Request, n: int, row: int, last_rows: dict[str, int], sampled: list[Request]
    ) -> ScheduledSeq:
        """Freeze the request's row (row `row` of the step) and advance num_computed_tokens.
        last_rows: the sampled rows of the step before, where a pending token comes from;
        sampled: the step's sampling requests so far, which a sampling row joins.

        Pages are registered in the prefix cache here, after every preemption decision of
        the step, so that no page whose KV this step will not write is ever cached; a page
        holding a token not yet back waits for a later step's commit.
        """
        start = req.num_computed_tokens
        end = start + n
        num_prompt = req.num_prompt_tokens
        outputs = req.output_token_ids
        known = num_prompt + len(outputs)
        if end <= num_prompt:
            token_ids = tuple(req.prompt_token_ids[start:end])
        elif start >= num_prompt:  # a decode
            token_ids = tuple(outputs[start - num_prompt : end - num_prompt])
        else:  # avoid building prompt + output
            token_ids = tuple(req.prompt_token_ids[start:]) + tuple(outputs[: end - num_prompt])
        feed_from_row = -1
        if end > known:  # the last token is the one the step in flight samples
            token_ids += (PLACEHOLDER_TOKEN,)
            feed_from_row = last_rows[req.request_id]
        bm = self.block_manager
        hashable = min(end, known)
        if bm.enable_prefix_caching and hashable // bm.block_size > bm.num_hashed_pages(req.request_id):
            bm.cache_full_blocks(req.request_id, req.all_token_ids, hashable, self._cache_root(req))
        req.num_computed_tokens = end
        slot_init = None
        if req.logits_spec is not None and req.slot < 0:
            req.slot = self._free_slots.pop()
            slot_init = SlotInit(
                req.slot, req.logits_spec, tuple(req.prompt_token_ids), tuple(req.output_token_ids)
            )
        targets = None
        if req.wants_prompt_logprobs and start < num_prompt - 1:
            targets = tuple(req.prompt_token_ids[start + 1 : min(end, num_prompt - 1) + 1])
        sampling = None
        if end == known + req.num_output_placeholders:
            sampling = _sampling_row(req)
            req.num_output_placeholders += 1
            self._sampled_rows[req.request_id] = row
            sampled.append(req)
        # (positional: the fields in their order, for speed)
        return ScheduledSeq(
            req.request_id,
            token_ids,
            start,
            bm.block_table(req.request_id),
            sampling,
            slot_init,
            targets,
            feed_from_row,
            req.lora_slot,
        )

    def _cache_root(self, req: Request):
        """Where the request's chain of page hashes starts: its adapter's root, or None."""
        lora = req.lora_request
        return None if lora is None else self.block_manager.root(lora.lora_int_id)

    def _free_slot(self, req: Request) -> None:
        """Give back the request's device slots: its logit-processing slot and its LoRA pin."""
        if req.lora_slot >= 0:
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = -1
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1

    # ---- update --------------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Append the sampled tokens and finish requests that stop; returns the requests
        that received a token (finished ones included). Rows of requests that finished since
        schedule() (aborted, or stopped by the step before) are dropped; a request preempted
        since then keeps its token. Logprobs asked for are kept on the request as ranked rows."""
        now = time.monotonic()
        # the requests as they were scheduled: one aborted since then is not a new one of the same id
        entry = self._unreported.pop(id(scheduler_output), None)
        if entry is not None and len(entry[1]) == len(runner_output.req_ids):
            sampled = entry[1]  # its sampled requests, in the order of the output's rows
        else:  # (a runner output with fewer rows than the step sampled)
            by_id = self.requests if entry is None else {r.request_id: r for r in entry[1]}
            sampled = [by_id.get(req_id) for req_id in runner_output.req_ids]
        if runner_output.prompt_logprobs:  # only then are the rows' start positions needed
            starts = {s.request_id: s.start_pos for s in scheduler_output.seqs}
        for req_id, ranked in runner_output.prompt_logprobs.items():
            req = self.requests.get(req_id)
            if req is not None:
                _extend_prompt_logprobs(req, starts[req_id], ranked)
        updated: list[Request] = []
        tokens = runner_output.sampled_token_ids.tolist()
        logprobs = runner_output.logprobs.tolist()
        top = runner_output.top_logprobs
        for row, (req, token, logprob) in enumerate(zip(sampled, tokens, logprobs, strict=True)):
            if req is None or req.is_finished:
                continue
            if req.num_output_placeholders:
                req.num_output_placeholders -= 1
            req.output_token_ids.append(token)
            req.cumulative_logprob += logprob
            if req.grammar is not None:
                req.grammar.accept(token)
            if req.sampling_params.logprobs is not None:
                req.output_logprobs.append(top.take(row))
            if req.first_token_time is None:
                req.first_token_time = now
            if (
                token in req.stop_ids
                or req.grammar is not None
                or len(req.output_token_ids) >= req.output_limit
            ):
                status = self._check_stop(req, token)  # (no other token can end the request)
                if status is not None:
                    self._finish(req, status)
            updated.append(req)
        return updated

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        """vLLM v1's check_stop order: min_tokens gates eos, then stop_token_ids, then
        length. Unlike vLLM, min_tokens never gates the length limit: a request must not
        outgrow max_model_len even if its min_tokens asks for more."""
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.terminated:  # nothing more fits its grammar
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.output_limit:  # max_tokens, or max_model_len reached
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- finishing -----------------------------------------------------------------------

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        status: RequestStatus,
        stop_reason: int | str | None = None,
    ) -> None:
        """Finish requests from outside the step (aborts, failed steps). Unknown or finished ids
        are ignored."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status.")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self._finish(req, status)

    def stop_on_strings(self, stops: Iterable[tuple[Request, str]]) -> None:
        """Stop strings the detokenizer found after update(): each request finishes as a stop
        with the string as its stop_reason. One that the same token already finished on length
        becomes a stop too, as vLLM reports it; one finished by EOS or a stop token id stays."""
        for req, stop in stops:
            if not req.is_finished:
                req.stop_reason = stop
                self._finish(req, RequestStatus.FINISHED_STOPPED)
            elif req.status == RequestStatus.FINISHED_LENGTH:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        del self.requests[req.request_id]
        self.block_manager.free(req.request_id)
        self._free_slot(req)
        req.status = status

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()

    def drop_all_kv(self) -> None:
        """The KV pool was rebuilt empty: every running request recomputes its tokens, and
        no cached page holds what its hash says any more."""
        for req in list(self.running):
            self._preempt(req, counted=False)  # not a preemption for lack of pages
        self.block_manager.reset_prefix_cache()


def _priority_key(req: Request) -> tuple[int, float]:
    return (req.priority, req.arrival_time)


def _sampling_row(req: Request) -> SamplingRow:
    """The request's row, built again only when its slot, banned tokens or grammar's activity
    changed since its last step."""
    row = req.sampling_row
    if (
        row is not None
        and row.slot == req.slot
        and req.grammar is None
        and not req.bad_words
        and not req.sampling_params.min_tokens
    ):
        return row  # the common case: nothing is ever banned and nothing constrains it
    banned = _banned_token_ids(req)
    constrained = req.grammar is not None and req.grammar.active
    if (
        row is not None
        and row.slot == req.slot
        and row.banned_token_ids == banned
        and row.constrained == constrained
    ):
        return row
    p = req.sampling_params
    row = req.sampling_row = SamplingRow(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        seed=req.seed,
        output_start=req.num_prompt_tokens,
        banned_token_ids=banned,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        slot=req.slot,
        logprobs=p.logprobs,
        constrained=constrained,
    )
    return row


def _banned_token_ids(req: Request) -> tuple[int, ...]:
    """Token ids masked for this step only: those that would end the request before
    min_tokens, and the last token of every multi-token bad word whose other tokens the
    output has just produced (vLLM looks at output tokens only)."""
    p = req.sampling_params
    num_output = req.num_output_tokens + req.num_output_placeholders
    if not req.bad_words and num_output >= p.min_tokens:
        return ()  # the common case, every step of most requests
    banned = set()
    if num_output < p.min_tokens:
        banned.update(p.stop_token_ids)
        if req.eos_token_id is not None and not p.ignore_eos:
            banned.add(req.eos_token_id)
    out = req.output_token_ids
    for word in req.bad_words:  # (a request with bad words is never scheduled ahead of its tokens)
        prefix = len(word) - 1
        if prefix <= len(out) and tuple(out[len(out) - prefix :]) == word[:-1]:
            banned.add(word[-1])
    return tuple(sorted(banned))


def _extend_prompt_logprobs(req: Request, start: int, ranked: TopLogprobs) -> None:
    """Row j of `ranked` is for prompt position start + j + 1; positions already known
    (a preempted request recomputes its prompt) are not added twice."""
    for j in range(len(ranked.chosen_ranks)):
        if start + j == len(req.prompt_logprobs):
            req.prompt_logprobs.append(ranked.take(j))
