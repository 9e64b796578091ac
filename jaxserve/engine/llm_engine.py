"""LLMEngine: the synchronous heart of jaxserve. One step() is the whole request path:

    schedule -> runner.execute -> scheduler.update -> detokenize (stop strings) -> outputs

The engine owns the tokenizer and the per-request detokenizers; the scheduler owns the
requests; the runner owns everything on the device. A request with n > 1 runs as n child
sequences that share the prompt (and, through the prefix cache, its pages).

Adding a request is two halves so that a server can validate and tokenize on its own
thread: make_request() checks and builds (touching no queue), enqueue() hands the result
to the scheduler. A step whose device call fails fails only the requests in that step.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats
from jaxserve.loader.generation_config import read_generation_config, sampling_defaults
from jaxserve.loader.tokenizer import load_tokenizer
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler_output import MAX_BANNED_TOKENS, LogitsSpec, TopLogprobs
from jaxserve.sharding import make_mesh

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int] | Mapping


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (its device state is lost)."""


@dataclass
class ParentRequest:
    """A user request: the prompt and its n child sequences."""

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

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None, devices=None):
        """devices: the ones this engine's mesh spans (default: the first tensor_parallel_size)."""
        self.config = config
        mesh = make_mesh(config.parallel_config.tensor_parallel_size, devices=devices)
        if tokenizer is not None:
            self.tokenizer, self.runner = tokenizer, ModelRunner(config, mesh)
        else:  # the tokenizer loads while the weights load and the first buckets compile
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-tokenizer") as pool:
                pending = pool.submit(load_tokenizer, config.model_config)
                self.runner = ModelRunner(config, mesh)
                self.tokenizer = pending.result()
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.runner.num_blocks)
        self._parents: dict[str, ParentRequest] = {}
        self._child_to_parent: dict[str, str] = {}
        self._last_token_time: dict[str, float] = {}  # child id -> when its last token came out
        self.iteration_stats = IterationStats()  # of the last step
        self._between_steps = IterationStats()  # aborts since the last step, counted with the next
        self._seed_rng = np.random.default_rng(config.model_config.seed)
        self._counter = itertools.count()
        mc = config.model_config
        self.generation_config = read_generation_config(mc.model, mc.generation_config)
        self.sampling_defaults = sampling_defaults(self.generation_config, mc.override_generation_config)
        self.eos_token_id, self.extra_eos_ids = self._eos_ids()

    @classmethod
    def from_engine_args(cls, engine_args) -> LLMEngine:
        """engine_args: an EngineArgs (args.py, which sits above the engine)."""
        return cls(engine_args.create_engine_config())

    def _eos_ids(self) -> tuple[int | None, set[int]]:
        """The tokenizer's eos, plus any other end-of-sequence ids the model or its
        generation config name (Llama 3 lists several), which stop like stop_token_ids."""
        ids = []
        for source in (self.config.model_config.hf_config, self.generation_config):
            eos = source.get("eos_token_id")
            ids += list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        primary = tok_eos if tok_eos is not None else (ids[0] if ids else None)
        return primary, {i for i in ids if i != primary}

    # ---- requests ------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("Text prompts need a tokenizer (skip_tokenizer_init is set).")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input."""
        self.enqueue(self.make_request(request_id, prompt, params, priority, arrival_time))

    def check_prompt_token_ids(self, token_ids: Sequence[int]) -> None:
        vocab = self.config.model_config.get("vocab_size")
        if vocab is not None and any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"Prompt token ids must be in [0, {vocab}).")

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> ParentRequest:
        """Check and tokenize a request and build its child sequences; ValueError on bad
        input. Touches no queue, so a server may call it off the engine's thread."""
        if request_id in self._parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError("priority is only honoured with scheduling_policy='priority'.")
        text, token_ids = self.tokenize_prompt(prompt)
        max_len = self.config.model_config.max_model_len
        if not token_ids:
            raise ValueError("The prompt is empty.")
        self.check_prompt_token_ids(token_ids)
        if len(token_ids) >= max_len:
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens; max_model_len is {max_len}, which leaves no room "
                "to generate."
            )
        self._check_logprobs(params)
        spec, bad_words = self._logits_spec(params)
        masked = len(bad_words) + (
            len(set(params.stop_token_ids) | self.extra_eos_ids) + 1 if params.min_tokens else 0
        )
        if masked > MAX_BANNED_TOKENS:
            raise ValueError(
                f"At most {MAX_BANNED_TOKENS} token ids can be masked per step: min_tokens masks the EOS and "
                f"stop token ids, and each multi-token bad word one more; this request needs {masked}."
            )
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        room = max_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        parent = ParentRequest(
            request_id,
            text,
            token_ids,
            [],
            arrival_time=arrival_time,
            n=params.n,
            best_of=params.best_of or params.n,
        )
        for i in range(params.best_of or params.n):
            child_params = params.clone(n=1, best_of=None)
            if params.seed is not None:
                child_params.seed = params.seed + i
            child_params.stop_token_ids = sorted(set(child_params.stop_token_ids) | self.extra_eos_ids)
            seed = child_params.seed if child_params.seed is not None else int(self._seed_rng.integers(2**31))
            child = Request(
                request_id if parent.best_of == 1 else f"{i}_{request_id}",
                token_ids,
                child_params,
                seed=seed,
                eos_token_id=self.eos_token_id,
                prompt=text,
                priority=priority,
                arrival_time=arrival_time,
                max_tokens=max_tokens,
            )
            child.logits_spec, child.bad_words = spec, bad_words
            child.wants_prompt_logprobs = params.prompt_logprobs is not None and i == 0  # once per request
            child.shares_prompt_with = parent.children[0] if i else None
            parent.children.append(child)
            parent.logprob_dicts.append([])
            det = None
            if self.tokenizer is not None and child_params.detokenize:
                det = IncrementalDetokenizer(self.tokenizer, child)
            parent.detokenizers.append(det)
        return parent

    def _check_logprobs(self, params: SamplingParams) -> None:
        limit = self.config.model_config.max_logprobs
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            value = getattr(params, name)
            if value is not None and limit != -1 and (value == -1 or value > limit):
                raise ValueError(
                    f"Requested {what} logprobs of {value}, which is greater than max allowed: {limit} "
                    "(--max-logprobs)."
                )

    def _logits_spec(self, params: SamplingParams) -> tuple[LogitsSpec | None, tuple[tuple[int, ...], ...]]:
        """The request's device slot contents (None if it needs no slot) and its multi-token
        bad words; ValueError for token ids outside the vocabulary."""
        vocab = self.runner.args.vocab_size

        def check(ids, what: str) -> None:
            bad = sorted({t for t in ids if not 0 <= t < vocab})
            if bad:
                raise ValueError(f"{what} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}.")

        bias = [(int(t), float(v)) for t, v in (params.logit_bias or {}).items()]
        check([t for t, _ in bias], "logit_bias")
        allowed = params.allowed_token_ids
        if allowed is not None:
            if not allowed:
                raise ValueError("allowed_token_ids must not be empty.")
            check(allowed, "allowed_token_ids")
            allowed = tuple(sorted(set(allowed)))
        multi: list[tuple[int, ...]] = []
        for ids in self._bad_words_token_ids(params.bad_words or []):
            if len(ids) == 1:
                bias.append((ids[0], -float("inf")))
            elif tuple(ids) not in multi:
                multi.append(tuple(ids))
        penalised = (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) != (
            0.0,
            0.0,
            1.0,
        )
        needs_slot = penalised or bias or allowed is not None
        return (LogitsSpec(tuple(bias), allowed) if needs_slot else None), tuple(multi)

    def _bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each bad word as the tokenizer writes it at the start of a text and, where that
        differs, after a space (vLLM's rule: the spaced form counts when it is as many tokens
        and starts with a different one)."""
        if words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer (skip_tokenizer_init is set).")
        out = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"bad_words entry {word!r} has no tokens.")
            out.append(plain)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                out.append(spaced)
        return out

    def enqueue(self, parent: ParentRequest) -> None:
        """Hand a request built by make_request to the scheduler."""
        if parent.request_id in self._parents:
            raise ValueError(f"Request id {parent.request_id!r} is already in use.")
        for child in parent.children:
            self.scheduler.add_request(child)
            self._child_to_parent[child.request_id] = parent.request_id
        self._parents[parent.request_id] = parent

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            self.scheduler.finish_requests(
                [c.request_id for c in parent.children], RequestStatus.FINISHED_ABORTED
            )
            self._record_finished(self._between_steps, parent, time.monotonic())
            self._forget(parent)

    def abort_all(self) -> None:
        self.abort_request(list(self._parents))

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def new_request_id(self) -> str:
        return str(next(self._counter))

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns a RequestOutput for every request that changed."""
        sched = self.scheduler.schedule(max_tokens=self.runner.ready_token_budget)
        self.iteration_stats = stats = self._between_steps
        stats.num_scheduled_tokens = sched.num_tokens
        self._between_steps = IterationStats()
        if sched.is_empty:
            return []
        try:
            runner_out = self.runner.execute(sched)
        except Exception as e:
            return self._fail_step(sched, e)
        updated = self.scheduler.update(sched, runner_out)
        now = time.monotonic()
        changed: dict[str, ParentRequest] = {}
        for req in updated:
            parent = self._parents.get(self._child_to_parent.get(req.request_id, ""))
            if parent is None:
                continue
            det = parent.detokenizers[parent.children.index(req)]
            if det is not None:
                stopped = req.status == RequestStatus.FINISHED_STOPPED
                stop = det.update(req.output_token_ids[-1:], stop_terminated=stopped)
                if stop is not None and not req.is_finished:
                    self.scheduler.finish_requests(
                        req.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop
                    )
                elif stop is not None and req.status == RequestStatus.FINISHED_LENGTH:
                    # The token that reached max_tokens also completed a stop string: as in
                    # vLLM, that is a stop (the request has already left the scheduler).
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            self._record_token(stats, parent, req, now)
            changed[parent.request_id] = parent
        # best_of > n reports only at the end, when the best samples are known
        outputs = [self._make_output(p) for p in changed.values() if p.finished or p.best_of == p.n]
        for out in outputs:
            if out.finished:
                parent = self._parents.pop(out.request_id)
                self._record_finished(stats, parent, now)
                self._forget(parent)
        return outputs

    def _record_token(self, stats: IterationStats, parent: ParentRequest, req: Request, now: float) -> None:
        stats.num_generation_tokens += 1
        last = self._last_token_time.get(req.request_id)
        if last is not None:
            stats.inter_token_latencies.append(now - last)
        self._last_token_time[req.request_id] = now
        if parent.first_token_time is None:
            parent.first_token_time = now
            stats.num_prompt_tokens += len(parent.prompt_token_ids)
            stats.time_to_first_tokens.append(now - parent.arrival_time)

    def _record_finished(self, stats: IterationStats, parent: ParentRequest, now: float) -> None:
        stats.finished.append(
            FinishedRequestStats(
                finish_reason=parent.children[0].status.finish_reason,
                e2e_latency=now - parent.arrival_time,
                num_prompt_tokens=len(parent.prompt_token_ids),
                num_generation_tokens=sum(c.num_output_tokens for c in parent.children),
            )
        )

    def _forget(self, parent: ParentRequest) -> None:
        for child in parent.children:
            self._child_to_parent.pop(child.request_id, None)
            self._last_token_time.pop(child.request_id, None)

    def _fail_step(self, sched, error: Exception) -> list[RequestOutput]:
        """The device call failed: fail every request that had a row in the step, keep the
        rest. If the failure took the KV pool with it (it is donated to the call), every
        live request's KV is gone: the pool is rebuilt and the survivors recompute."""
        logger.error("Engine step failed; failing the requests in it", exc_info=error)
        message = "The engine failed while running this request (the server log has the details)."
        failed = {self._child_to_parent.get(s.request_id) for s in sched.seqs} - {None}
        outputs = []
        for rid in failed:
            parent = self._parents.pop(rid)
            ids = [c.request_id for c in parent.children]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            self._forget(parent)
            out = self._make_output(parent)
            out.error = message
            outputs.append(out)
        if self.runner.kv_pool_lost:
            try:
                self.runner.reset_kv_pool()
            except Exception as e:
                raise EngineDeadError(f"cannot rebuild the KV cache after a failed step: {e}") from e
            self.scheduler.drop_all_kv()
        return outputs

    def flush_stats(self) -> IterationStats | None:
        """Stats of what happened since the last step (aborts), if anything; for an idle
        engine, which has no next step to carry them."""
        if not self._between_steps.finished:
            return None
        stats, self._between_steps = self._between_steps, IterationStats()
        return stats

    def scheduler_stats(self) -> SchedulerStats:
        s = self.scheduler
        prefix = s.prefix_cache_stats
        return SchedulerStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=s.num_preemptions,
        )

    def _make_output(self, parent: ParentRequest) -> RequestOutput:
        """The request's outputs so far. With best_of > n, the n samples of highest
        cumulative logprob once all have finished (nothing is reported before)."""
        chosen = list(range(len(parent.children)))
        if parent.best_of > parent.n:
            if parent.finished:
                chosen.sort(key=lambda i: -parent.children[i].cumulative_logprob)
            chosen = chosen[: parent.n] if parent.finished else []
        completions = []
        for index, i in enumerate(chosen):
            child, det = parent.children[i], parent.detokenizers[i]
            wants = child.sampling_params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=index,
                    text=det.stream_text(child.is_finished) if det is not None else "",
                    token_ids=list(child.output_token_ids),
                    cumulative_logprob=child.cumulative_logprob if wants else None,
                    logprobs=self._logprob_dicts(
                        parent.logprob_dicts[i],
                        child.output_logprobs,
                        child.output_token_ids,
                        child.sampling_params.logprobs,
                    )
                    if wants
                    else None,
                    finish_reason=child.status.finish_reason,
                    stop_reason=child.stop_reason,
                )
            )
        first = parent.children[0]
        prompt_logprobs = None
        if first.wants_prompt_logprobs:
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
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens,
        )

    def _logprob_dicts(
        self, built: list[dict], rows: list[TopLogprobs], chosen: Sequence[int], k: int
    ) -> list[dict[int, Logprob]]:
        """vLLM's logprobs: per position the chosen token, then the top k (-1: all) with
        their ranks and texts. Extends `built` with the rows that arrived since."""
        for row, token in zip(rows[len(built) :], chosen[len(built) :]):
            k_row = len(row.ids) if k == -1 else k
            ids = [int(token), *row.ids[:k_row].tolist()]
            lps = [float(row.chosen_logprobs), *row.logprobs[:k_row].tolist()]
            ranks = [int(row.chosen_ranks), *range(1, k_row + 1)]
            texts = self._token_texts(ids)
            entry: dict[int, Logprob] = {}
            for t, lp, rank, text in zip(ids, lps, ranks, texts):
                entry.setdefault(t, Logprob(lp, rank, text))
            built.append(entry)
        return list(built)

    def _token_texts(self, ids: list[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(ids)
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        return [self.tokenizer.convert_tokens_to_string([t]) if t is not None else "" for t in tokens]
