"""SchedulerOutput -> BatchInputs: the padded arrays of one step, built on the host in
numpy and sent to the device in one transfer.

Layout: the new tokens of every scheduled sequence back to back, then padding up to the
token bucket; per-sequence arrays padded up to the sequence bucket. Padding tokens write
their KV to a slot past the pool (dropped) and padding sequences have no tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.sampler import SamplingArrays
from jaxserve.scheduler_output import MAX_BANNED_TOKENS, SchedulerOutput


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class BatchInputs:
    input_ids: np.ndarray  # [num_tokens] int32
    positions: np.ndarray  # [num_tokens] int32
    meta: AttentionMetadata
    logits_indices: np.ndarray  # [num_seqs] int32, last new token of each sequence
    sampling: SamplingArrays
    # [num_tokens] int32: for a fed prompt token whose logprob-successor is wanted
    # (prompt_logprobs), that successor's id; -1 elsewhere
    prompt_targets: np.ndarray
    # [num_tokens] int32: for a token the host does not have yet (asynchronous scheduling), the row
    # of the previous step's sampled tokens it is taken from on the device; -1 elsewhere
    feed_rows: np.ndarray


def prepare(
    sched: SchedulerOutput,
    num_tokens: int,  # token bucket
    num_seqs: int,  # sequence bucket
    page_size: int,
    pages_per_seq: int,
    pad_slot: int,  # a slot index past the KV pool: writes there are dropped
    attention_backend: str,  # the kernel the step traces (AttentionMetadata.backend)
) -> BatchInputs:
    seqs = sched.seqs
    n = len(seqs)
    if sched.num_tokens > num_tokens or n > num_seqs:
        raise ValueError(
            f"step of {sched.num_tokens} tokens / {n} seqs exceeds bucket ({num_tokens}, {num_seqs})"
        )
    q_lens = np.fromiter((s.num_new for s in seqs), np.int32, n)
    starts = np.fromiter((s.start_pos for s in seqs), np.int32, n)
    cu = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(q_lens, out=cu[1 : n + 1])
    cu[n + 1 :] = cu[n]
    total = int(cu[n])

    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, pad_slot, np.int32)
    page_indices = np.zeros((num_seqs, pages_per_seq), np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    if n:
        input_ids[:total] = np.fromiter((t for s in seqs for t in s.token_ids), np.int32, total)
        seq_of_token = np.repeat(np.arange(n), q_lens)
        pos = starts[seq_of_token] + (np.arange(total) - cu[seq_of_token])
        positions[:total] = pos
        for i, s in enumerate(seqs):
            page_indices[i, : len(s.block_ids)] = s.block_ids
        slot_mapping[:total] = page_indices[seq_of_token, pos // page_size] * page_size + pos % page_size
        kv_lens[:n] = starts + q_lens

    logits_indices = np.zeros(num_seqs, np.int32)
    logits_indices[:n] = np.maximum(cu[1 : n + 1] - 1, 0)

    temperature = np.zeros(num_seqs, np.float32)
    top_k = np.zeros(num_seqs, np.int32)
    top_p = np.ones(num_seqs, np.float32)
    min_p = np.zeros(num_seqs, np.float32)
    seeds = np.zeros(num_seqs, np.uint32)
    steps = np.zeros(num_seqs, np.int32)
    banned = np.full((num_seqs, MAX_BANNED_TOKENS), -1, np.int32)
    presence = np.zeros(num_seqs, np.float32)
    frequency = np.zeros(num_seqs, np.float32)
    repetition = np.ones(num_seqs, np.float32)
    slot = np.full(num_seqs, -1, np.int32)
    prompt_targets = np.full(num_tokens, -1, np.int32)
    feed_rows = np.full(num_tokens, -1, np.int32)
    for i, s in enumerate(seqs):
        r = s.sampling
        if r is not None:
            temperature[i], top_k[i], top_p[i], min_p[i] = r.temperature, r.top_k, r.top_p, r.min_p
            seeds[i], steps[i] = r.seed & 0xFFFFFFFF, r.step
            banned[i, : len(r.banned_token_ids)] = r.banned_token_ids
            presence[i], frequency[i], repetition[i] = (
                r.presence_penalty,
                r.frequency_penalty,
                r.repetition_penalty,
            )
            slot[i] = r.slot
        targets = s.prompt_logprob_targets
        if targets:
            prompt_targets[cu[i] : cu[i] + len(targets)] = targets
        if s.feed_from_row >= 0:
            feed_rows[cu[i + 1] - 1] = s.feed_from_row

    return BatchInputs(
        input_ids=input_ids,
        positions=positions,
        meta=AttentionMetadata(
            slot_mapping=slot_mapping,
            kv_lens=kv_lens,
            page_indices=page_indices,
            cu_q_lens=cu,
            num_seqs=np.array([n], np.int32),
            backend=attention_backend,
        ),
        logits_indices=logits_indices,
        sampling=SamplingArrays(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=seeds,
            steps=steps,
            banned=banned,
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            slot=slot,
        ),
        prompt_targets=prompt_targets,
        feed_rows=feed_rows,
    )
