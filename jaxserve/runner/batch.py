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

import dataclasses
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import NamedTuple

import jax
import numpy as np

from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.sampler import SamplingArrays
from jaxserve.models.causal_lm import InputEmbeds
from jaxserve.scheduler_output import FLOAT_COLUMNS, INT_COLUMNS, MAX_BANNED_TOKENS, SchedulerOutput

_TOKEN_IDS, _START_POS, _BLOCK_IDS, _SAMPLING, _PROMPT_TARGETS, _FEED_FROM_ROW, _NUM_DRAFTS = (
    attrgetter(f)
    for f in (
        "token_ids", "start_pos", "block_ids", "sampling", "prompt_logprob_targets", "feed_from_row", "num_drafts"
    )
)  # fmt: skip
_FLOAT_PARAMS, _INT_PARAMS, _LORA_SLOT, _PROMPT_EMBEDS = map(
    attrgetter, ("float_params", "int_params", "lora_slot", "prompt_embeds")
)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class BatchInputs:
    input_ids: np.ndarray  # [num_tokens] int32
    positions: np.ndarray  # [num_tokens] int32
    meta: AttentionMetadata
    # [logits rows] int32, the fed token each row's logits are taken at: each sequence's last
    # token; in the verify layout also its proposed tokens and the token before them
    logits_indices: np.ndarray
    sampling: SamplingArrays  # a row per logits row
    # [num_tokens] int32: for a fed prompt token whose logprob-successor is wanted
    # (prompt_logprobs), that successor's id; -1 elsewhere
    prompt_targets: np.ndarray
    # [num_tokens] int32: for a token the host does not have yet (asynchronous scheduling), the row
    # of the previous step's sampled tokens it is taken from on the device; -1 elsewhere
    feed_rows: np.ndarray
    # [num_tokens] int32: each token's LoRA slot (-1: the base model); None without LoRA slots
    lora_slots: np.ndarray | None = None
    # The verify layout (speculative decoding), else None. [logits rows] int32: the proposed token
    # that the row's sample is checked against (-1: none, a row's last); [num_seqs + 1] int32:
    # sequence i's logits rows are [cu_num_logits[i], cu_num_logits[i + 1])
    draft_tokens: np.ndarray | None = None
    cu_num_logits: np.ndarray | None = None
    # Prompts given as embeddings: their rows at their tokens' places; None when no row has any
    input_embeds: InputEmbeds | None = None
    # [3, num_tokens] int32, an M-RoPE model's (time, height, width) positions of each token; None
    # for every other model
    rope_positions: np.ndarray | None = None


class _Ragged(NamedTuple):
    """Where each row's tokens sit in the flat token axis."""

    num_rows: int
    q_lens: np.ndarray  # [num_rows] int32, tokens fed per row
    cu: np.ndarray  # [seq bucket + 1] int32, row i's tokens are [cu[i], cu[i + 1]); padding rows empty
    total: int  # tokens fed in all

    @classmethod
    def of(cls, token_lists: list, num_seqs: int) -> _Ragged:
        n = len(token_lists)
        q_lens = np.fromiter(map(len, token_lists), np.int32, n)
        cu = np.zeros(num_seqs + 1, np.int32)
        np.cumsum(q_lens, out=cu[1 : n + 1])
        cu[n + 1 :] = cu[n]
        return cls(n, q_lens, cu, int(cu[n]))

    def last_tokens(self) -> np.ndarray:
        """[num_rows] each row's last fed token (0 for a row fed none)."""
        return np.maximum(self.cu[1 : self.num_rows + 1] - 1, 0)


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
    logits_per_seq: int = 1,  # > 1: the verify layout, up to this many logits rows per sequence
    mrope: bool = False,  # the model's rope takes three positions a token (BatchInputs.rope_positions)
    microbatch_tokens: int = 0,  # under a pipeline (AttentionMetadata.microbatch_tokens)
) -> BatchInputs:
    """The step's arrays: tokens and attention metadata, sampling rows, and the per-token extras.
    Every row field is gathered by C-level iteration (no Python loop over the rows)."""
    seqs = sched.seqs
    if sched.num_tokens > num_tokens or len(seqs) > num_seqs:
        raise ValueError(
            f"step of {sched.num_tokens} tokens / {len(seqs)} seqs exceeds bucket ({num_tokens}, {num_seqs})"
        )
    token_lists = list(map(_TOKEN_IDS, seqs))
    ragged = _Ragged.of(token_lists, num_seqs)
    input_ids, positions, meta = _tokens_and_pages(
        seqs,
        token_lists,
        ragged,
        num_tokens,
        page_size,
        pages_per_seq,
        pad_slot,
        attention_backend,
        kv_scales,
        microbatch_tokens,
    )
    lora_slots = None
    if with_lora:
        lora_slots = np.full(num_tokens, -1, np.int32)
        lora_slots[: ragged.total] = np.repeat(
            np.fromiter(map(_LORA_SLOT, seqs), np.int32, len(seqs)), ragged.q_lens
        )
    inputs = BatchInputs(
        input_ids=input_ids,
        positions=positions,
        meta=meta,
        logits_indices=np.zeros(num_seqs, np.int32),
        sampling=_sampling_arrays(seqs, num_seqs, meta.kv_lens),
        prompt_targets=_prompt_targets(seqs, ragged, num_tokens),
        feed_rows=_feed_rows(seqs, ragged, num_tokens),
        lora_slots=lora_slots,
        input_embeds=_input_embeds(list(map(_PROMPT_EMBEDS, seqs)), ragged, num_tokens),
        rope_positions=_rope_positions(seqs, ragged, positions) if mrope else None,
    )
    if logits_per_seq > 1:
        return _verify_layout(inputs, seqs, ragged, min(num_tokens, num_seqs * logits_per_seq))
    inputs.logits_indices[: ragged.num_rows] = ragged.last_tokens()
    return inputs


def _verify_layout(inputs: BatchInputs, seqs, ragged: _Ragged, num_logits: int) -> BatchInputs:
    """The inputs with a logits row at each proposed token of a sequence and at the token before
    them (a row without proposals: its last token alone), each with its sequence's sampling row,
    sampling the output index of the token it predicts."""
    n, num_seqs = ragged.num_rows, len(ragged.cu) - 1
    rows_of = 1 + np.fromiter(map(_NUM_DRAFTS, seqs), np.int32, n)  # logits rows of each sequence
    cu_logits = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(rows_of, out=cu_logits[1 : n + 1])
    cu_logits[n + 1 :] = cu_logits[n]
    total = int(cu_logits[n])
    seq_of = np.repeat(np.arange(n), rows_of)  # [total] each logits row's sequence
    back = rows_of[seq_of] - 1 - (np.arange(total) - cu_logits[seq_of])  # rows after it in its sequence
    indices = np.zeros(num_logits, np.int32)
    indices[:total] = ragged.cu[seq_of] + ragged.q_lens[seq_of] - 1 - back
    drafts = np.full(num_logits, -1, np.int32)
    proposed = back > 0
    drafts[:total][proposed] = inputs.input_ids[indices[:total][proposed] + 1]
    gather = np.full(num_logits, num_seqs, np.int32)  # padding rows: a neutral row appended below
    gather[:total] = seq_of
    neutral = _sampling_arrays((), 1, np.zeros(1, np.int32))
    sampling = SamplingArrays(
        **{
            f.name: np.concatenate([getattr(inputs.sampling, f.name), getattr(neutral, f.name)])[gather]
            for f in dataclasses.fields(SamplingArrays)
        }
    )
    sampling.steps[:total] -= back.astype(np.int32)  # the output index of the token each row predicts
    return dataclasses.replace(
        inputs, logits_indices=indices, sampling=sampling, draft_tokens=drafts, cu_num_logits=cu_logits
    )


def _tokens_and_pages(
    seqs,
    token_lists: list,
    ragged: _Ragged,
    num_tokens: int,
    page_size: int,
    pages_per_seq: int,
    pad_slot: int,
    attention_backend: str,
    kv_scales: np.ndarray | None,
    microbatch_tokens: int,
) -> tuple[np.ndarray, np.ndarray, AttentionMetadata]:
    """input_ids and positions [token bucket], and the attention metadata: each token's KV slot,
    each row's pages and KV length."""
    n, total, cu = ragged.num_rows, ragged.total, ragged.cu
    num_seqs = len(cu) - 1
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, pad_slot, np.int32)
    page_indices = np.zeros((num_seqs, pages_per_seq), np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    if n:
        tables = list(map(_BLOCK_IDS, seqs))
        starts = np.fromiter(map(_START_POS, seqs), np.int32, n)
        num_pages = np.fromiter(map(len, tables), np.int32, n)
        input_ids[:total] = np.fromiter(chain.from_iterable(token_lists), np.int32, total)
        seq_of_token = np.repeat(np.arange(n), ragged.q_lens)
        pos = starts[seq_of_token] + (np.arange(total) - cu[seq_of_token])
        positions[:total] = pos
        seq_of_page = np.repeat(np.arange(n), num_pages)
        first_page = np.cumsum(num_pages) - num_pages
        pages = np.fromiter(chain.from_iterable(tables), np.int32, len(seq_of_page))
        page_indices[seq_of_page, np.arange(len(seq_of_page)) - first_page[seq_of_page]] = pages
        slot_mapping[:total] = page_indices[seq_of_token, pos // page_size] * page_size + pos % page_size
        kv_lens[:n] = starts + ragged.q_lens
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        kv_lens=kv_lens,
        page_indices=page_indices,
        cu_q_lens=cu,
        num_seqs=np.array([n], np.int32),
        backend=attention_backend,
        kv_scales=kv_scales,
        microbatch_tokens=microbatch_tokens,
    )
    return input_ids, positions, meta


_STEP_COLUMN = list(INT_COLUMNS).index("steps")
_NEUTRAL_FLOATS = np.array(list(FLOAT_COLUMNS.values()), np.float32)
_NEUTRAL_INTS = np.array([neutral for neutral, _ in INT_COLUMNS.values()], np.int64)
_INT_DTYPES = tuple((name, dtype) for name, (_, dtype) in INT_COLUMNS.items())


def _sampling_arrays(seqs, num_seqs: int, kv_lens: np.ndarray) -> SamplingArrays:
    """The sampling rows as columns (FLOAT_COLUMNS, INT_COLUMNS); neutral on rows that sample
    nothing and on padding rows."""
    floats = np.empty((num_seqs, len(_NEUTRAL_FLOATS)), np.float32)
    floats[:] = _NEUTRAL_FLOATS
    ints = np.empty((num_seqs, len(_NEUTRAL_INTS)), np.int64)
    ints[:] = _NEUTRAL_INTS
    banned = np.full((num_seqs, MAX_BANNED_TOKENS), -1, np.int32)
    samplings = list(map(_SAMPLING, seqs))
    sampled = [i for i, r in enumerate(samplings) if r is not None]
    if sampled:
        n, k = len(seqs), len(sampled)
        rows = samplings if k == n else [samplings[i] for i in sampled]
        at = slice(0, n) if k == n else sampled
        width_f, width_i = floats.shape[1], ints.shape[1]
        floats[at] = np.fromiter(
            chain.from_iterable(map(_FLOAT_PARAMS, rows)), np.float32, width_f * k
        ).reshape(k, width_f)
        ints[at] = np.fromiter(chain.from_iterable(map(_INT_PARAMS, rows)), np.int64, width_i * k).reshape(
            k, width_i
        )
        ints[at, _STEP_COLUMN] += kv_lens[at]  # the sampled token's position less the prompt's length
        for i, r in zip(sampled, rows):
            if r.banned_token_ids:
                banned[i, : len(r.banned_token_ids)] = r.banned_token_ids
    columns = {name: column.copy() for name, column in zip(FLOAT_COLUMNS, floats.T)}
    for (name, dtype), column in zip(_INT_DTYPES, ints.T):
        columns[name] = column.astype(dtype)
    return SamplingArrays(banned=banned, **columns)


def _prompt_targets(seqs, ragged: _Ragged, num_tokens: int) -> np.ndarray:
    """[token bucket] int32: at each fed prompt token whose logprob-successor is wanted, that
    successor's id; -1 elsewhere."""
    out = np.full(num_tokens, -1, np.int32)
    all_targets = list(map(_PROMPT_TARGETS, seqs))
    if any(all_targets):
        for i, targets in enumerate(all_targets):
            if targets:
                out[ragged.cu[i] : ragged.cu[i] + len(targets)] = targets
    return out


def _input_embeds(all_embeds: list, ragged: _Ragged, num_tokens: int) -> InputEmbeds | None:
    """The rows fed in place of the embedding table's at their tokens' places in the token
    bucket, and where they are; None when no row has any. A row's are an array (a prompt given as
    embeddings: its first tokens) or (offsets from its first token, rows) (a prompt's images)."""
    present = [(i, e) for i, e in enumerate(all_embeds) if e is not None]
    if not present:
        return None
    width = present[0][1][1].shape[1] if isinstance(present[0][1], tuple) else present[0][1].shape[1]
    rows = np.zeros((num_tokens, width), np.float32)
    mask = np.zeros(num_tokens, np.int32)
    for i, e in present:
        at = ragged.cu[i]
        where = at + e[0] if isinstance(e, tuple) else slice(at, at + len(e))
        rows[where] = e[1] if isinstance(e, tuple) else e
        mask[where] = 1
    return InputEmbeds(rows, mask)


def _rope_positions(seqs, ragged: _Ragged, positions: np.ndarray) -> np.ndarray:
    """[3, token bucket] int32: a token's sequence position three times, but for the rows whose
    prompt holds images (ScheduledSeq.rope_positions)."""
    out = np.broadcast_to(positions, (3, positions.shape[0])).copy()
    for i, s in enumerate(seqs):
        if s.rope_positions is not None:
            out[:, ragged.cu[i] : ragged.cu[i + 1]] = s.rope_positions
    return out


def _feed_rows(seqs, ragged: _Ragged, num_tokens: int) -> np.ndarray:
    """[token bucket] int32: at a row's last token when the host does not have it yet, the row
    of the previous step's sampled tokens it comes from; -1 elsewhere."""
    out = np.full(num_tokens, -1, np.int32)
    feed_from = np.fromiter(map(_FEED_FROM_ROW, seqs), np.int32, len(seqs))
    fed = feed_from >= 0
    out[ragged.cu[1 : ragged.num_rows + 1][fed] - 1] = feed_from[fed]
    return out


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
