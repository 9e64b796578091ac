"""SchedulerOutput -> BatchInputs: the padded arrays of one step, built on the host in
numpy and sent to the device in one transfer.

Layout: the new tokens of every scheduled sequence back to back, then padding up to the
token bucket; per-sequence arrays padded up to the sequence bucket. Padding tokens write
their KV to a slot past the pool (dropped) and padding sequences have no tokens.

On the way to the device the ~20 arrays travel packed into one int32 buffer (PackedBatch: their
32-bit words, floats included), which the step unpacks inside its program: one transfer a step
instead of one per array, more than a millisecond less host work per step at 256 rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import jax
import numpy as np

from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.sampler import SamplingArrays
from jaxserve.scheduler_output import MAX_BANNED_TOKENS, SchedulerOutput

_TOKEN_IDS, _START_POS, _BLOCK_IDS, _SAMPLING, _PROMPT_TARGETS, _FEED_FROM_ROW = (
    attrgetter(f)
    for f in ("token_ids", "start_pos", "block_ids", "sampling", "prompt_logprob_targets", "feed_from_row")
)
_FLOAT_PARAMS, _INT_PARAMS = attrgetter("float_params"), attrgetter("int_params")


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
    # [num_tokens] int32: each token's LoRA slot (-1: the base model); None without LoRA slots
    lora_slots: np.ndarray | None = None


def prepare(
    sched: SchedulerOutput,
    num_tokens: int,  # token bucket
    num_seqs: int,  # sequence bucket
    page_size: int,
    pages_per_seq: int,
    pad_slot: int,  # a slot index past the KV pool: writes there are dropped
    attention_backend: str,  # the kernel the step traces (AttentionMetadata.backend)
    kv_scales: np.ndarray | None = None,  # [num_layers, 2] float32, a quantized pool's (AttentionMetadata)
    with_lora: bool = False,  # the model has LoRA slots: each token's slot goes with the batch
) -> BatchInputs:
    seqs = sched.seqs
    n = len(seqs)
    if sched.num_tokens > num_tokens or n > num_seqs:
        raise ValueError(
            f"step of {sched.num_tokens} tokens / {n} seqs exceeds bucket ({num_tokens}, {num_seqs})"
        )
    # The rows' fields, each gathered by C-level iteration (no Python loop over the rows).
    token_lists = list(map(_TOKEN_IDS, seqs))
    tables = list(map(_BLOCK_IDS, seqs))
    q_lens = np.fromiter(map(len, token_lists), np.int32, n)
    starts = np.fromiter(map(_START_POS, seqs), np.int32, n)
    num_pages = np.fromiter(map(len, tables), np.int32, n)
    feed_from = np.fromiter(map(_FEED_FROM_ROW, seqs), np.int32, n)
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
        input_ids[:total] = np.fromiter(chain.from_iterable(token_lists), np.int32, total)
        seq_of_token = np.repeat(np.arange(n), q_lens)
        pos = starts[seq_of_token] + (np.arange(total) - cu[seq_of_token])
        positions[:total] = pos
        seq_of_page = np.repeat(np.arange(n), num_pages)
        first_page = np.cumsum(num_pages) - num_pages
        pages = np.fromiter(chain.from_iterable(tables), np.int32, len(seq_of_page))
        page_indices[seq_of_page, np.arange(len(seq_of_page)) - first_page[seq_of_page]] = pages
        slot_mapping[:total] = page_indices[seq_of_token, pos // page_size] * page_size + pos % page_size
        kv_lens[:n] = starts + q_lens

    logits_indices = np.zeros(num_seqs, np.int32)
    logits_indices[:n] = np.maximum(cu[1 : n + 1] - 1, 0)

    # Sampling parameters: neutral (greedy, no filter, no penalty) on rows that sample nothing.
    floats = np.zeros((num_seqs, 6), np.float32)  # temperature, top_p, min_p, presence, frequency, repetition
    floats[:, 1] = floats[:, 5] = 1.0
    ints = np.zeros((num_seqs, 4), np.int64)  # top_k, seed, step, slot
    ints[:, 3] = -1
    banned = np.full((num_seqs, MAX_BANNED_TOKENS), -1, np.int32)
    samplings = list(map(_SAMPLING, seqs))
    sampled = [i for i, r in enumerate(samplings) if r is not None]
    if sampled:
        rows = samplings if len(sampled) == n else [samplings[i] for i in sampled]
        k = len(rows)
        at = slice(0, n) if k == n else sampled
        floats[at] = np.fromiter(chain.from_iterable(map(_FLOAT_PARAMS, rows)), np.float32, 6 * k).reshape(
            k, 6
        )
        ints[at] = np.fromiter(chain.from_iterable(map(_INT_PARAMS, rows)), np.int64, 4 * k).reshape(k, 4)
        ints[at, 2] += kv_lens[at]  # the sampled token's position less the prompt's length
        for i, r in zip(sampled, rows):
            if r.banned_token_ids:
                banned[i, : len(r.banned_token_ids)] = r.banned_token_ids
    prompt_targets = np.full(num_tokens, -1, np.int32)
    all_targets = list(map(_PROMPT_TARGETS, seqs))
    if any(all_targets):
        for i, targets in enumerate(all_targets):
            if targets:
                prompt_targets[cu[i] : cu[i] + len(targets)] = targets
    feed_rows = np.full(num_tokens, -1, np.int32)
    fed = feed_from >= 0
    feed_rows[cu[1 : n + 1][fed] - 1] = feed_from[fed]  # each such row's last token

    lora_slots = None
    if with_lora:
        lora_slots = np.full(num_tokens, -1, np.int32)
        lora_slots[:total] = np.repeat(np.fromiter((s.lora_slot for s in seqs), np.int32, n), q_lens)
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
            kv_scales=kv_scales,
        ),
        logits_indices=logits_indices,
        sampling=SamplingArrays(
            temperature=floats[:, 0].copy(),
            top_k=ints[:, 0].astype(np.int32),
            top_p=floats[:, 1].copy(),
            min_p=floats[:, 2].copy(),
            seeds=ints[:, 1].astype(np.uint32),
            steps=ints[:, 2].astype(np.int32),
            banned=banned,
            presence=floats[:, 3].copy(),
            frequency=floats[:, 4].copy(),
            repetition=floats[:, 5].copy(),
            slot=ints[:, 3].astype(np.int32),
        ),
        prompt_targets=prompt_targets,
        feed_rows=feed_rows,
        lora_slots=lora_slots,
    )


@jax.tree_util.register_pytree_node_class
class PackedBatch:
    """A BatchInputs as one flat int32 buffer (every array's 32-bit words, floats included) and,
    static, how to cut it apart."""

    def __init__(self, words, layout: tuple):
        self.words, self.layout = words, layout

    @classmethod
    def pack(cls, inputs: BatchInputs) -> PackedBatch:
        leaves, treedef = jax.tree.flatten(inputs)
        layout = (treedef, tuple((x.dtype, x.shape) for x in leaves))
        return cls(np.concatenate([x.view(np.int32).ravel() for x in leaves]), layout)

    def unpack(self) -> BatchInputs:
        """The BatchInputs again (inside the step: slices of the buffer)."""
        treedef, specs = self.layout
        leaves, at = [], 0
        for dtype, shape in specs:
            size = int(np.prod(shape))
            x = self.words[at : at + size].reshape(shape)
            at += size
            if dtype != np.int32:
                x = jax.lax.bitcast_convert_type(x, dtype)
            leaves.append(x)
        return jax.tree.unflatten(treedef, leaves)

    def tree_flatten(self):
        return (self.words,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(*children, layout)


def unpacked(inputs: BatchInputs | PackedBatch) -> BatchInputs:
    return inputs.unpack() if isinstance(inputs, PackedBatch) else inputs
