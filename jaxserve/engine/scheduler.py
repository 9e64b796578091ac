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
from collections.abc import Callable, Iterable

from jaxserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jaxserve.engine.block_manager import BlockManager, PrefixCacheStats
from jaxserve.engine.lora_slots import LoRASlots
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.request_rows import (
    add_pooled,
    drop_outputs_after,
    extend_prompt_logprobs,
    fed_token_ids,
    max_proposals,
    prompt_logprob_targets,
    sampling_row,
    stop_status,
    target_tokens,
)
from jaxserve.engine.stats import SpecDecodingStats
from jaxserve.engine.step_plan import Admission, InFlightStep, StepPlan
from jaxserve.engine.swap_space import SwapSpace
from jaxserve.scheduler_output import (
    PLACEHOLDER_TOKEN,
    ModelRunnerOutput,
    ProcessorSlotInit,
    ScheduledSeq,
    SchedulerOutput,
)
from jaxserve.spec_decode.proposers import Proposer, proposer_for


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        num_lora_slots: int = 0,
        clock: Callable[[], float] = time.monotonic,
        speculative_config: SpeculativeConfig | None = None,
        proposer: Proposer | None = None,
        swap_space: SwapSpace | None = None,
    ) -> None:
        """clock: the engine's clock, the one requests' arrival times are on (seconds).
        speculative_config: rows of decoding requests are fed proposed tokens (spec_decode/), from
        `proposer` if given (a draft model's, which the engine builds), else the method's own.
        swap_space: swap preemption's host pages (preemption_mode swap), which the engine sizes."""
        if scheduler_config.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {scheduler_config.policy!r}.")
        self.config = scheduler_config
        self.swap = swap_space  # preempted requests whose KV waits in host memory
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
        # Steps scheduled and not yet updated, by id
        self._unreported: dict[int, InFlightStep] = {}
        self._sampled_rows: dict[str, int] = {}  # request id -> its sampled row in the last step
        self.num_preemptions = 0
        # long_prefill_token_threshold, where it applies (chunked prefill on); 0: no cap
        self._chunk_cap = (
            scheduler_config.long_prefill_token_threshold if scheduler_config.enable_chunked_prefill else 0
        )
        # Processor slots: device rows for per-request logit processing (penalties, bias): one per running
        # request at most, so max_num_seqs of them never run out.
        self._free_processor_slots = list(range(scheduler_config.max_num_seqs - 1, -1, -1))
        self.lora_slots = LoRASlots(num_lora_slots) if num_lora_slots else None
        # scheduler_delay_factor: how long the last step that started prompts took
        self.clock = clock
        # speculative decoding's source of proposed tokens, up to num_speculative_tokens a row
        # (a draft model's, which needs the device, comes from the engine: `proposer`)
        self.proposer: Proposer | None = proposer or proposer_for(speculative_config)
        self.num_speculative_tokens = speculative_config.num_speculative_tokens if speculative_config else 0
        self._propose_up_to = (speculative_config and speculative_config.disable_by_batch_size) or None
        self.spec_stats = SpecDecodingStats() if speculative_config is not None else None
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
        limit = self.config.max_num_batched_tokens
        plan = StepPlan(budget=min(limit, max_tokens or limit))
        self._schedule_running(plan)
        now = self.clock()
        # Waiting requests start unless this step had to preempt: pages are short, and the
        # preempted requests must not be readmitted ahead of the running ones.
        if self._prompts_may_start(now) and not plan.preempted:
            self._admit_waiting(plan, now)
        return self._commit_step(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        """Running requests, in order: decodes and the next chunks of ongoing prefills."""
        running, allocate = self.running, self.block_manager.allocate
        proposing = self._proposing()
        drafts = self._propose_on_pages(plan.budget) if proposing and self.proposer.needs_pages else None
        i = 0
        while i < len(running) and plan.budget > 0:
            req = running[i]
            n = self._chunk_size(req, req.num_computed_tokens, plan.budget)
            if n == 1 and proposing and not req.num_output_placeholders:  # (proposals need its last token)
                n += self._propose(req, plan.budget, drafts)
                if n > 1 and not allocate(req.request_id, req.num_computed_tokens + n):
                    n, req.draft_token_ids = 1, ()  # proposals never cost another request its pages
            if n > 0:
                if not allocate(req.request_id, req.num_computed_tokens + n):
                    if not self._preempt_for(req, n, plan):
                        return  # the request preempted itself: nothing below it can get pages either
                    i = running.index(req)  # a victim may have stood before req
                plan.add(req, n)
            i += 1

    def _proposing(self) -> bool:
        """Rows get proposals this step: there is a proposer, and no more requests than
        disable_by_batch_size (if set) are running or waiting."""
        if self.proposer is None:
            return False
        return self._propose_up_to is None or len(self.running) + len(self.waiting) <= self._propose_up_to

    def _propose(self, req: Request, budget: int, drafts: dict[str, list[int]] | None) -> int:
        """Proposed tokens for a decoding request's row, kept on the request until its tokens
        are back; how many. drafts: what a proposer that runs on the requests' pages proposed
        for this step (None: the proposer is asked here)."""
        k = max_proposals(req, self.num_speculative_tokens, budget)
        if drafts is not None:
            proposed = drafts.get(req.request_id, ())[:k]
        else:
            proposed = (
                self.proposer.propose(req.request_id, req.all_token_ids, req.num_prompt_tokens, k)
                if k
                else ()
            )
        req.draft_token_ids = tuple(proposed)
        return len(proposed)

    def _propose_on_pages(self, budget: int) -> dict[str, list[int]]:
        """Proposals for the decoding requests, from a proposer that writes into their pages (a
        draft model's KV): each first gets the pages of its proposals, where free pages allow
        (never by preempting), and those that got them are proposed for in one call."""
        rows = []
        for req in self.running:
            k = max_proposals(req, self.num_speculative_tokens, budget)
            if k and self.block_manager.allocate(req.request_id, req.num_computed_tokens + 1 + k):
                rows.append(
                    (req.request_id, req.all_token_ids, self.block_manager.block_ids(req.request_id), k)
                )
        return self.proposer.propose_many(rows) if rows else {}

    def _preempt_for(self, req: Request, n: int, plan: StepPlan) -> bool:
        """Pages for the request's next n tokens by preempting from the tail of the running
        queue until they fit; False when the request itself was preempted."""
        while True:
            victim = self._pick_victim()
            plan.preempted = True
            plan.drop(victim)  # (under the priority policy it may be scheduled already)
            self._preempt(victim)
            if victim is req:
                return False
            if self.block_manager.allocate(req.request_id, req.num_computed_tokens + n):
                return True

    def _admit_waiting(self, plan: StepPlan, now: float) -> None:
        """Waiting requests, in queue order, while the budget, the row limit and pages last."""
        w = 0
        # pooling requests whose whole prompt is scheduled end when their step is back: no row of
        # this step is theirs (with asynchronous scheduling, they are still running while it is
        # planned); counted only when a request waits, so a decode-only step pays nothing for it
        done = 0
        if self.waiting:
            done = sum(
                1
                for r in self.running
                if r.pooling_params is not None and r.num_computed_tokens >= r.num_tokens
            )
        while (
            w < len(self.waiting) and plan.budget > 0 and len(self.running) - done < self.config.max_num_seqs
        ):
            admission = self._admit(w, plan, now)
            if admission is Admission.STOP:
                return
            if admission is Admission.SKIP:
                w += 1

    def _admit(self, w: int, plan: StepPlan, now: float) -> Admission:
        """Start waiting request `w` with its first chunk (what the prefix cache holds of its
        tokens counted as computed), let it wait for now, or stop admitting."""
        req = self.waiting[w]
        if self._waits_for_prompt_pages(req) or req.num_output_placeholders:
            # a sibling sample: admitted once the first one has its prompt in pages; a
            # preempted request: once the token of the step in flight is back
            return Admission.SKIP
        swapped = self.swap is not None and req.request_id in self.swap.swapped
        if req.wants_prompt_logprobs or swapped:  # every prompt token must run / its KV comes back
            computed_blocks, num_cached = [], req.num_computed_tokens if swapped else 0
        else:
            computed_blocks, num_cached = self.block_manager.get_computed_blocks(
                req.all_token_ids, self._cache_root(req)
            )
        n = self._chunk_size(req, num_cached, plan.budget)
        if not self.config.enable_chunked_prefill and num_cached + n < req.num_tokens:
            return Admission.STOP  # the whole prompt must fit; keep strict order rather than skip it
        if req.lora_request is not None:
            req.lora_slot = self.lora_slots.acquire(req.lora_request)
            if req.lora_slot is None:  # every slot is pinned by other adapters: it waits
                req.lora_slot = -1
                return Admission.SKIP
        if not self.block_manager.allocate(req.request_id, num_cached + n, computed_blocks):
            self._release_slots(req)
            return Admission.STOP
        self.waiting.pop(w)
        if swapped:
            self.swap.swap_in(req.request_id, self.block_manager.block_table(req.request_id))
        if req.status == RequestStatus.WAITING:  # its first time, not a preempted one's return
            req.num_cached_tokens = num_cached
            req.scheduled_time = now
            if self.block_manager.enable_prefix_caching:
                self.block_manager.stats.record(req.num_tokens, num_cached)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        self.running.append(req)
        plan.add(req, n)
        self._prompts_started_at = now
        return Admission.ADMITTED

    def _commit_step(self, plan: StepPlan) -> SchedulerOutput:
        """The step as the runner sees it: every planned row frozen, in the plan's order."""
        last_rows, self._sampled_rows = self._sampled_rows, {}
        sampled: list[Request] = []  # _commit adds the requests whose row samples, in row order
        n = plan.num_tokens
        seqs = tuple(
            [
                self._commit(req, n[req.request_id], row, last_rows, sampled)
                for row, req in enumerate(plan.requests)
            ]
        )
        lora_loads = self.lora_slots.take_loads() if self.lora_slots is not None else ()
        # (a step that does not run leaves its copies to the next one)
        swap = self.swap.take() if self.swap is not None and seqs else None
        sched = SchedulerOutput(seqs=seqs, lora_loads=lora_loads, swap=swap or None)
        if seqs:
            self._unreported[id(sched)] = InFlightStep(sched, tuple(sampled))
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
        grammar or bad words depend on the token it samples, proposals on the tokens kept."""
        step = self._unreported.get(id(sched))
        if step is None or not step.sampled:
            return False
        # speculative decoding: the next positions follow how many of this step's proposals it
        # keeps, and the next proposals the tokens it samples; without proposals in this step, the
        # next waits for its tokens only where one is likely (the proposer finds one on the tokens
        # known now), else it is planned ahead without proposals like any asynchronous step
        if any(s.num_drafts for s in sched.seqs) or (self._proposing() and self._would_propose(step.sampled)):
            return True
        return any(r.grammar is not None or r.bad_words for r in step.sampled)

    def _would_propose(self, requests: list[Request]) -> bool:
        """Whether the proposer has a proposal for some request on its tokens known now (the one
        in flight left out); a draft model always has."""
        if self.proposer.needs_pages:
            return True
        k = self.num_speculative_tokens
        return any(
            self.proposer.propose(r.request_id, r.all_token_ids, r.num_prompt_tokens, k)
            for r in requests
            if not r.is_finished
        )

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
        n = target_tokens(req) - num_computed
        if n > 1 and self._chunk_cap:
            n = min(n, self._chunk_cap)  # leave budget for other prefills in the same step
        return min(n, budget)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt(self, req: Request, counted: bool = True) -> None:
        """Preemption by recompute: drop the KV, keep the tokens; the request's prompt and
        outputs so far are prefilled again when it is readmitted (mostly from the prefix
        cache, if its pages have not been evicted by then). Or by swap (swap_space.py): its
        pages go to host memory and come back when it is readmitted (not with proposals in
        flight: the tokens they will keep are unknown)."""
        self.running.remove(req)
        bm = self.block_manager
        swapped = (
            counted
            and self.swap is not None
            and not req.draft_token_ids
            and req.pooling_params is None
            and self.swap.swap_out(
                req.request_id, req.num_computed_tokens, bm.block_size, bm.block_table(req.request_id)
            )
        )
        bm.free(req.request_id)
        self._release_slots(req)
        req.status = RequestStatus.PREEMPTED
        if not swapped:
            req.num_computed_tokens = 0
        req.draft_token_ids = ()
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
        drafts = req.draft_token_ids
        end = start + n - len(drafts)  # past the request's own tokens (the proposals follow)
        known = req.num_prompt_tokens + len(req.output_token_ids)
        token_ids = fed_token_ids(req, start, end)
        feed_from_row = -1
        if end > known:  # the last token is the one the step in flight samples
            token_ids += (PLACEHOLDER_TOKEN,)
            feed_from_row = last_rows[req.request_id]
        bm = self.block_manager
        hashable = min(end, known)
        if bm.enable_prefix_caching and hashable // bm.block_size > bm.num_hashed_pages(req.request_id):
            bm.cache_full_blocks(req.request_id, req.all_token_ids, hashable, self._cache_root(req))
        req.num_computed_tokens = start + n
        processor_init = None
        if req.logits_spec is not None and req.processor_slot < 0:
            req.processor_slot = self._free_processor_slots.pop()
            prompt_ids = (
                () if req.prompt_embeds is not None else tuple(req.prompt_token_ids)
            )  # (placeholders)
            processor_init = ProcessorSlotInit(
                req.processor_slot, req.logits_spec, prompt_ids, tuple(req.output_token_ids)
            )
        sampling = None
        if end == known + req.num_output_placeholders and req.pooling_params is None:
            sampling = sampling_row(req)
            req.num_output_placeholders += 1
            self._sampled_rows[req.request_id] = row
            sampled.append(req)
        # (positional: the fields in their order, for speed)
        return ScheduledSeq(
            req.request_id,
            token_ids + drafts if drafts else token_ids,
            start,
            bm.block_table(req.request_id),
            sampling,
            processor_init,
            prompt_logprob_targets(req, start, end) if req.wants_prompt_logprobs else None,
            feed_from_row,
            req.lora_slot,
            len(drafts),
            None if req.prompt_embeds is None else _embeds_rows(req, start, end),
            None if req.images is None else req.images.rows_for(start, min(end, req.num_prompt_tokens)),
            None if req.images is None or req.images.rope is None else req.images.rope_for(start, start + n),
        )

    def _cache_root(self, req: Request):
        """Where the request's chain of page hashes starts: its adapter's root, or None; then,
        for a prompt given as embeddings, the digest of their bytes."""
        lora = req.lora_request
        root = None if lora is None else self.block_manager.root(lora.lora_int_id)
        if req.embeds_digest is not None:
            root = self.block_manager.embeds_root(root, req.embeds_digest)
        return root

    def _release_slots(self, req: Request) -> None:
        """Give back the request's device slots: its processor slot and its LoRA slot's pin."""
        if req.lora_slot >= 0:
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = -1
        if req.processor_slot >= 0:
            self._free_processor_slots.append(req.processor_slot)
            req.processor_slot = -1

    # ---- update --------------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Append the sampled tokens and finish requests that stop; returns the requests
        that received a token (finished ones included). Rows of requests that finished since
        schedule() (aborted, or stopped by the step before) are dropped; a request preempted
        since then keeps its token. Logprobs asked for are kept on the request as ranked rows."""
        now = self.clock()
        # the requests as they were scheduled: one aborted since then is not a new one of the same id
        step = self._unreported.pop(id(scheduler_output), None)
        if runner_output.pooled is not None:
            return self._add_pooled(scheduler_output, runner_output, now)
        if step is not None and len(step.sampled) == len(runner_output.req_ids):
            sampled = step.sampled  # its sampled requests, in the order of the output's rows
        else:  # (a runner output with fewer rows than the step sampled)
            by_id = self.requests if step is None else {r.request_id: r for r in step.sampled}
            sampled = [by_id.get(req_id) for req_id in runner_output.req_ids]
        if runner_output.prompt_logprobs:  # only then are the rows' start positions needed
            starts = {s.request_id: s.start_pos for s in scheduler_output.seqs}
        for req_id, ranked in runner_output.prompt_logprobs.items():
            req = self.requests.get(req_id)
            if req is not None:
                extend_prompt_logprobs(req, starts[req_id], ranked)
        tokens = runner_output.sampled_token_ids.tolist()
        logprobs = runner_output.logprobs.tolist()
        if runner_output.num_sampled is not None:
            return self._append_verified(sampled, runner_output, tokens, logprobs, now)
        updated: list[Request] = []
        top = runner_output.top_logprobs
        for row, (req, token, logprob) in enumerate(zip(sampled, tokens, logprobs, strict=True)):
            if req is None or req.is_finished:
                continue
            if req.num_output_placeholders:
                req.num_output_placeholders -= 1
            req.num_new_tokens = 1
            self._append(req, token, logprob, top, row, now)
            updated.append(req)
        return updated

    def _append(self, req: Request, token: int, logprob: float, top, row: int, now: float) -> None:
        """One output token: kept with its logprobs, fed to the grammar, and the request
        finished if it ends there."""
        req.output_token_ids.append(token)
        req.cumulative_logprob += logprob
        if req.grammar is not None:
            req.grammar.accept(token)
        if req.sampling_params.logprobs is not None:
            req.output_logprobs.append(top.take(row))
        if req.first_token_time is None:
            req.first_token_time = now
        if token in req.stop_ids or req.grammar is not None or len(req.output_token_ids) >= req.output_limit:
            status = stop_status(req, token)  # (no other token can end the request)
            if status is not None:
                self._finish(req, status)

    def _append_verified(
        self, sampled, runner_output: ModelRunnerOutput, tokens: list, logprobs: list, now: float
    ) -> list[Request]:
        """A step with proposals: each request's tokens in turn, up to one that ends it. The KV of
        the proposals that were not kept is written over by the next step's tokens."""
        updated: list[Request] = []
        top = runner_output.top_logprobs
        end = 0
        for req, count in zip(sampled, runner_output.num_sampled.tolist(), strict=True):
            start, end = end, end + count
            if req is None or req.is_finished:
                continue
            if req.num_output_placeholders:
                req.num_output_placeholders -= 1
            num_drafts, req.draft_token_ids = len(req.draft_token_ids), ()
            if num_drafts:
                self.spec_stats.observe(num_drafts, count - 1)
            before = req.num_output_tokens
            for row in range(start, end):
                self._append(req, tokens[row], logprobs[row], top, row, now)
                if req.is_finished:
                    break
            req.num_new_tokens = req.num_output_tokens - before
            req.new_logprobs = logprobs[start : start + req.num_new_tokens]
            if not req.is_finished:
                req.num_computed_tokens -= num_drafts + 1 - count
            updated.append(req)
        return updated

    def _add_pooled(self, sched: SchedulerOutput, out: ModelRunnerOutput, now: float) -> list[Request]:
        """A pooling model's step: each row's sums (and tokens' rows) added to its request's; a
        request whose last prompt chunk this was ends (its vector is the OutputProcessor's to make)."""
        updated, end = [], 0
        for seq, row in zip(sched.seqs, out.pooled):
            start, end = end, end + len(seq.token_ids)
            req = self.requests.get(seq.request_id)
            if req is None or req.is_finished:
                continue
            tokens = None if out.pooled_tokens is None else out.pooled_tokens[start:end]
            if add_pooled(req, seq, row, tokens):
                req.num_new_tokens, req.first_token_time = 0, now
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                updated.append(req)
        return updated

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
            if status == RequestStatus.FINISHED_ERROR:  # its last step may not have written its pages
                self.block_manager.uncache(req_id)
            self._finish(req, status)

    def stop_on_strings(self, stops: Iterable[tuple[Request, str, int]]) -> None:
        """Stop strings the detokenizer found after update(), each with the output tokens up to
        the one that completed it: each request finishes as a stop with the string as its
        stop_reason, and tokens a step kept after that one are dropped. One that the same token
        already finished on length becomes a stop too, as vLLM reports it; one finished by EOS or
        a stop token id stays."""
        for req, stop, num_tokens in stops:
            if num_tokens < req.num_output_tokens:
                drop_outputs_after(req, num_tokens)
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
        if self.swap is not None:
            self.swap.drop(req.request_id)
        self._release_slots(req)
        req.status = status
        req.draft_token_ids = ()
        if self.proposer is not None:
            self.proposer.finish(req.request_id, req.all_token_ids, req.num_prompt_tokens)

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()

    def drop_all_kv(self) -> None:
        """The KV pool was rebuilt empty: every running request recomputes its tokens, and
        no cached page holds what its hash says any more."""
        for req in list(self.running):
            self._preempt(req, counted=False)  # not a preemption for lack of pages
        self.block_manager.reset_prefix_cache()


def _embeds_rows(req: Request, start: int, end: int):
    """The embeddings of a prompt given as such for its positions [start, end), or None past the
    prompt (a request recomputed after preemption feeds its output tokens as tokens)."""
    return req.prompt_embeds[start:end] if start < req.num_prompt_tokens else None


def _priority_key(req: Request) -> tuple[int, float]:
    return (req.priority, req.arrival_time)
