"""OutputProcessor: from the tokens a step produced to the RequestOutputs callers see.

Where it sits: the last step of the engine's loop, after Scheduler.update(). It holds every
live ParentRequest from enqueue to its final output, and for each new token it detokenizes
incrementally (reporting stop strings, which the Scheduler then applies: it alone writes request
state), builds vLLM's logprob dicts once per row, chooses the n best of best_of samples at the
end, and records the per-request timings the metrics are made of.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from jaxserve.config import PoolerConfig
from jaxserve.engine.parent_request import ParentRequest
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.stats import FinishedRequestStats, IterationStats
from jaxserve.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput
from jaxserve.pooling_params import finish_classification, finish_embedding, finish_reward
from jaxserve.scheduler_output import TopLogprobs


class ChildRef(NamedTuple):
    """Where a child sequence belongs: its parent request and its index among the children."""

    parent: ParentRequest
    index: int


class OutputProcessor:
    def __init__(
        self,
        tokenizer,
        clock: Callable[[], float] = time.monotonic,
        pooler_config: PoolerConfig | None = None,
    ) -> None:
        """pooler_config: a pooling model's, which finishes its requests' vectors."""
        self.tokenizer = tokenizer
        self.pooler_config = pooler_config
        self.clock = clock  # the engine's: requests' arrival times are on it
        self.parents: dict[str, ParentRequest] = {}
        self._children: dict[str, ChildRef] = {}  # child id -> where it belongs
        self._last_token_time: dict[str, float] = {}  # child id -> when its last token came out
        self.tracer = None  # engine/tracing.py's RequestTracer: told of each finished request

    # ---- the registry ---------------------------------------------------------------------

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for i, child in enumerate(parent.children):
            self._children[child.request_id] = ChildRef(parent, i)

    def pop(self, request_id: str) -> ParentRequest | None:
        """Forget a request (finished, aborted or failed); None if it is not live."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for child in parent.children:
                self._children.pop(child.request_id, None)
                self._last_token_time.pop(child.request_id, None)
        return parent

    def parent_ids(self, child_ids: Sequence[str]) -> set[str]:
        return {self._children[c].parent.request_id for c in child_ids if c in self._children}

    # ---- a step's tokens -------------------------------------------------------------------

    def detokenize(self, updated: Sequence[Request]) -> list[tuple[Request, str, int]]:
        """Feed each request's new tokens to its detokenizer; the stop strings that completed, each
        with the number of output tokens up to the one that completed it."""
        stops = []
        for req in updated:
            ref = self._children.get(req.request_id)
            det = ref.parent.detokenizers[ref.index] if ref else None
            if det is None:
                continue
            out = req.output_token_ids
            stop = det.update(
                out[len(out) - req.num_new_tokens :], stop_terminated=req.finished_on_stop_token
            )
            if stop is not None:
                stops.append((req, stop, det.num_output_tokens))
        return stops

    def make_outputs(self, updated: Sequence[Request], stats: IterationStats) -> list[RequestOutput]:
        """A RequestOutput for every request that got a token (best_of > n, or output_kind
        FINAL_ONLY: only at the end); finished requests are forgotten."""
        now = self.clock()
        changed: dict[str, ParentRequest] = {}
        for req in updated:
            ref = self._children.get(req.request_id)
            if ref is None:
                continue
            parent = ref.parent
            self._record_token(stats, parent, req, now)
            # a parent can only have finished if the child that got a token has
            if parent.reports_progress or req.is_finished:
                changed[parent.request_id] = parent
        outputs = [self.make_output(p) for p in changed.values() if p.reports_progress or p.finished]
        for out in outputs:
            if out.finished:
                self.record_finished(stats, self.pop(out.request_id), now)
        return outputs

    def _record_token(self, stats: IterationStats, parent: ParentRequest, req: Request, now: float) -> None:
        stats.num_generation_tokens += req.num_new_tokens
        last = self._last_token_time.get(req.request_id)
        if last is not None:
            stats.inter_token_latencies.append(now - last)
        self._last_token_time[req.request_id] = now
        if parent.first_token_time is None:
            parent.first_token_time = now
            stats.num_prompt_tokens += len(parent.prompt_token_ids)
            stats.time_to_first_tokens.append(now - parent.arrival_time)

    def record_finished(self, stats: IterationStats, parent: ParentRequest, now: float) -> None:
        scheduled = [c.scheduled_time for c in parent.children if c.scheduled_time is not None]
        first = parent.first_token_time
        stats.finished.append(
            FinishedRequestStats(
                finish_reason=parent.children[0].status.finish_reason,
                e2e_latency=now - parent.arrival_time,
                num_prompt_tokens=len(parent.prompt_token_ids),
                num_generation_tokens=sum(c.num_output_tokens for c in parent.children),
                request_id=parent.request_id,
                arrival_time=parent.arrival_time,
                queue_time=min(scheduled) - parent.arrival_time if scheduled else None,
                time_to_first_token=None if first is None else first - parent.arrival_time,
                sampling_params=parent.children[0].sampling_params,
                trace_headers=parent.trace_headers,
            )
        )
        if self.tracer is not None:
            self.tracer.record(stats.finished[-1:])

    # ---- building outputs ------------------------------------------------------------------

    def make_output(self, parent: ParentRequest) -> RequestOutput | PoolingRequestOutput:
        """The request's outputs so far, or with output_kind DELTA what is new since the last
        (the prompt's logprobs in the first output only). With best_of > n, the n samples of
        highest cumulative logprob once all have finished (nothing is reported before). A
        pooling request's: its vector, once it has finished."""
        if parent.children[0].pooling_params is not None:
            return self._pooled(parent)
        chosen = list(range(len(parent.children)))
        if parent.best_of > parent.n:
            if parent.finished:
                chosen.sort(key=lambda i: -parent.children[i].cumulative_logprob)
            chosen = chosen[: parent.n] if parent.finished else []
        delta = parent.reports_deltas
        if delta and not parent.reported:
            parent.reported = [0] * len(parent.children)
        completions = [self._completion(parent, i, index, delta) for index, i in enumerate(chosen)]
        first = parent.children[0]
        prompt_logprobs = None
        if first.wants_prompt_logprobs and not parent.prompt_reported:
            parent.prompt_reported = delta
            dicts = self._logprob_dicts(
                parent.prompt_logprob_dicts,
                first.prompt_logprobs,
                parent.prompt_token_ids[1:],
                first.sampling_params.prompt_logprobs,
            )
            prompt_logprobs = [None, *dicts]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=None if parent.from_embeds else parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens,
        )

    def _pooled(self, parent: ParentRequest) -> PoolingRequestOutput:
        """A pooling request's vector: the pooler's reduction of its prompt, cut to its dimensions
        and normalized as resolved, or a classifier's probabilities (empty if it failed)."""
        req = parent.children[0]
        data = np.zeros(0, np.float32)
        if req.status == RequestStatus.FINISHED_STOPPED:
            pooler, params = self.pooler_config, req.pooling_params
            vector = req.pooled.vector(pooler.pooling_type, req.num_prompt_tokens)
            if pooler.task == "classify":
                data = finish_classification(vector, params.use_activation)
            elif pooler.task == "reward":
                data = finish_reward(
                    vector,
                    req.prompt_token_ids,
                    pooler.step_tag_id,
                    pooler.returned_token_ids,
                    params.use_activation,
                )
            else:
                data = finish_embedding(vector, params.dimensions, params.normalize)
        return PoolingRequestOutput(
            request_id=parent.request_id,
            outputs=PoolingOutput(data),
            prompt_token_ids=parent.prompt_token_ids,
            finished=parent.finished,
            prompt=parent.prompt,
        )

    def _completion(self, parent: ParentRequest, i: int, index: int, delta: bool) -> CompletionOutput:
        """Child i's output as the `index`-th completion: all of it, or what is new (`delta`)."""
        child, det = parent.children[i], parent.detokenizers[i]
        start = parent.reported[i] if delta else 0
        k = child.sampling_params.logprobs
        logprobs = None
        if k is not None and delta:  # built for this output alone, not kept
            logprobs = self._entries(child.output_logprobs[start:], child.output_token_ids[start:], k)
        elif k is not None:
            built = parent.logprob_dicts[i]
            logprobs = list(self._logprob_dicts(built, child.output_logprobs, child.output_token_ids, k))
        if det is None:
            text = ""
        else:
            text = det.get_delta(child.is_finished) if delta else det.stream_text(child.is_finished)
        if delta:
            parent.reported[i] = child.num_output_tokens
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=child.output_token_ids[start:],
            cumulative_logprob=child.cumulative_logprob if k is not None else None,
            logprobs=logprobs,
            finish_reason=child.status.finish_reason,
            stop_reason=child.stop_reason,
        )

    def _logprob_dicts(
        self, built: list[dict], rows: list[TopLogprobs], chosen: Sequence[int], k: int
    ) -> list[dict[int, Logprob]]:
        """Extends `built` with the entries (see _entries) of the rows that arrived since; returns it."""
        built.extend(self._entries(rows[len(built) :], chosen[len(built) :], k))
        return built

    def _entries(
        self, rows: Sequence[TopLogprobs], chosen: Sequence[int], k: int
    ) -> list[dict[int, Logprob]]:
        """vLLM's logprobs: per position the chosen token, then the top k (-1: all) with their
        ranks and texts."""
        entries = []
        for row, token in zip(rows, chosen):
            k_row = len(row.ids) if k == -1 else k
            ids = [int(token), *row.ids[:k_row].tolist()]
            lps = [float(row.chosen_logprobs), *row.logprobs[:k_row].tolist()]
            ranks = [int(row.chosen_ranks), *range(1, k_row + 1)]
            texts = self._token_texts(ids)
            entry: dict[int, Logprob] = {}
            for t, lp, rank, text in zip(ids, lps, ranks, texts):
                entry.setdefault(t, Logprob(lp, rank, text))
            entries.append(entry)
        return entries

    def _token_texts(self, ids: list[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(ids)
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        return [self.tokenizer.convert_tokens_to_string([t]) if t is not None else "" for t in tokens]
