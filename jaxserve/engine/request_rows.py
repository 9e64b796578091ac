"""What one request puts into a step and takes out of it, as pure functions of the request: the
tokens its row is fed, its sampling row, the prompt tokens its prompt logprobs rank, and, when
its token is back, whether it stops and where its prompt logprobs go.

The Scheduler decides which requests run and how many tokens each; these say what that means
for one request's row.
"""

from __future__ import annotations

from jaxserve.engine.request import Request, RequestStatus
from jaxserve.scheduler_output import SamplingRow, ScheduledSeq, TopLogprobs


def target_tokens(req: Request) -> int:
    """The tokens whose KV the request needs before its next sample: all it has, and the one a
    step in flight is sampling for it, unless that token will end it on length anyway."""
    known = req.num_prompt_tokens + len(req.output_token_ids)
    pending = req.num_output_placeholders
    if pending and known + pending - req.num_prompt_tokens < req.output_limit:
        return known + pending
    return known


def fed_token_ids(req: Request, start: int, end: int) -> tuple[int, ...]:
    """The known tokens at positions [start, end) of prompt + output (fewer when the last is the
    one a step in flight samples)."""
    num_prompt = req.num_prompt_tokens
    outputs = req.output_token_ids
    if end <= num_prompt:
        return tuple(req.prompt_token_ids[start:end])
    if start >= num_prompt:  # a decode
        return tuple(outputs[start - num_prompt : end - num_prompt])
    return tuple(req.prompt_token_ids[start:]) + tuple(outputs[: end - num_prompt])  # not prompt + output


def prompt_logprob_targets(req: Request, start: int, end: int) -> tuple[int, ...] | None:
    """For a row fed positions [start, end): the prompt tokens that follow its prompt positions,
    each ranked at the position before it (prompt_logprobs); None when the row asks for none."""
    num_prompt = req.num_prompt_tokens
    if not req.wants_prompt_logprobs or start >= num_prompt - 1:
        return None
    return tuple(req.prompt_token_ids[start + 1 : min(end, num_prompt - 1) + 1])


def sampling_row(req: Request) -> SamplingRow:
    """The request's row, built again only when its processor slot, banned tokens or grammar's activity
    changed since its last step."""
    row = req.sampling_row
    if (
        row is not None
        and row.processor_slot == req.processor_slot
        and req.grammar is None
        and not req.bad_words
        and not req.sampling_params.min_tokens
    ):
        return row  # the common case: nothing is ever banned and nothing constrains it
    banned = banned_token_ids(req)
    constrained = req.grammar is not None and req.grammar.active
    if (
        row is not None
        and row.processor_slot == req.processor_slot
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
        processor_slot=req.processor_slot,
        logprobs=p.logprobs,
        constrained=constrained,
    )
    return row


def banned_token_ids(req: Request) -> tuple[int, ...]:
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


def stop_status(req: Request, token: int) -> RequestStatus | None:
    """How the request ends on `token`, its last output, if it does (a stop token id becomes its
    stop_reason). vLLM v1's check_stop
    order: min_tokens gates eos, then stop_token_ids, then length. Unlike vLLM, min_tokens never
    gates the length limit: a request must not outgrow max_model_len even if its min_tokens asks
    for more."""
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


def extend_prompt_logprobs(req: Request, start: int, ranked: TopLogprobs) -> None:
    """Row j of `ranked` is for prompt position start + j + 1; positions already known
    (a preempted request recomputes its prompt) are not added twice."""
    for j in range(len(ranked.chosen_ranks)):
        if start + j == len(req.prompt_logprobs):
            req.prompt_logprobs.append(ranked.take(j))


def max_proposals(req: Request, k: int, budget: int) -> int:
    """How many proposed tokens the request's next row may take (speculative decoding): up to k,
    within the step's token budget and what the request may still output; none for a row that is
    not a decode of its last token, nor for one whose sampling depends on the tokens before it in
    ways the step does not follow proposal by proposal (a grammar, bad words, the tokens
    min_tokens holds back)."""
    p = req.sampling_params
    if req.grammar is not None or req.bad_words or req.num_output_tokens < p.min_tokens:
        return 0
    if req.num_computed_tokens != req.num_tokens - 1:
        return 0
    return max(0, min(k, budget - 1, req.output_limit - req.num_output_tokens - 1))


def drop_outputs_after(req: Request, num_tokens: int) -> None:
    """Keep the request's first num_tokens outputs (and their logprobs): a stop string ended it
    before the last token its step kept."""
    dropped = req.num_output_tokens - num_tokens
    req.cumulative_logprob -= sum(req.new_logprobs[-dropped:])
    del req.output_token_ids[num_tokens:]
    del req.output_logprobs[num_tokens:]
    req.num_new_tokens -= dropped


def add_pooled(req: Request, seq: ScheduledSeq, row, tokens=None) -> bool:
    """A pooling request's row of a step ([3, width]: its chunk's sums; `tokens`: its tokens' rows,
    ALL pooling) added to its own; whether the chunk ended its prompt (a chunk from position 0
    starts them over: a recomputed prompt)."""
    ends = seq.start_pos + len(seq.token_ids) == req.num_prompt_tokens
    req.pooled.add(row, seq.start_pos == 0, ends, tokens)
    return ends
