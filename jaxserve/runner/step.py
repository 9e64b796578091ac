"""The device program of one step: the model's forward over a ragged token batch, logits at
the rows that need them, and sampling, all inside one jit.

ModelRunner compiles `step` once per shape bucket and variant. Everything the program depends
on is an argument: the arrays, and, bound before jit, the model graph, the variant and the
top-k width; the attention backend rides in the batch's AttentionMetadata as a static field.
The only context a trace reads is JAX's own mesh (jax.set_mesh, for layers that split work by
hand), which jit keys on too, and, when a benchmark measures a pipeline, whether its timeline is
recorded (layers/pipeline.py record_timeline), which the step's cache keys name; so a compiled
step is a function of what its cache key names.

The step comes in variants (StepVariant), each compiled the first time a batch needs it and
never per request. The plain variant is what start-up compiles; a batch that needs none of
the extras never pays for them.

Every program takes the previous step's sampled tokens (`last_tokens`, still on the device) and
returns its own, padded to the largest sequence bucket: a row whose last token the host does not
have yet (asynchronous scheduling) is fed it from there.

A step with structured outputs runs as two programs, `forward` then `sample_step`, instead of the
fused `step`: the host fills the grammar's token mask while the device runs the forward pass, and
the mask is an argument of the second program only.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.layers.sampler import ProcessorState, apply_token_bitmask, count_sampled, sample, top_logprobs
from jaxserve.pooling_params import TOKENWISE_TYPES
from jaxserve.runner.batch import BatchInputs, PackedBatch, unpacked
from jaxserve.scheduler_output import SchedulerOutput, TopLogprobs

_SAMPLING, _PROMPT_TARGETS, _EXTRAS, _NUM_DRAFTS, _PROMPT_EMBEDS = map(
    attrgetter, ("sampling", "prompt_logprob_targets", "extras", "num_drafts", "prompt_embeds")
)
# Rows of prompt logprobs computed at once: their [rows, vocab] float32 logits are live together.
PROMPT_CHUNK = 512


@dataclass(frozen=True)
class StepVariant:
    """The optional work of a compiled step. Each extra costs every row of the batch (a
    vocabulary-sized gather, a top-k, logits at every token), so a step does only what some
    row of its batch asked for."""

    # Bias rows, allowed tokens and penalties from the device ProcessorState, which the step
    # takes, updates (counting the sampled tokens) and returns.
    with_processor_state: bool = False
    # The top-k logprobs and the rank of each sampled token (a request's `logprobs`).
    with_top_logprobs: bool = False
    # Logits at every fed token, ranked against each prompt token's successor (`prompt_logprobs`).
    with_prompt_logprobs: bool = False
    # A packed token mask per row (structured outputs); runs as forward + sample_step.
    with_token_bitmask: bool = False
    # Rows fed in place of the embedding table's at some tokens (prompts given as embeddings).
    with_prompt_embeds: bool = False
    # The program's kind: "generate" samples one token per sequence; "verify" (speculative
    # decoding) samples at each proposed token too and keeps the samples that agree with the
    # proposals, plus one (BatchInputs' verify layout); "pool" (a pooling model's only kind)
    # samples nothing and returns each row's pooled hidden states (`pool`; it takes no options);
    # "pool_all" also every fed token's (ALL pooling).
    kind: str = "generate"

    KINDS = ("generate", "verify", "pool", "pool_all")

    @classmethod
    def all(cls) -> tuple[StepVariant, ...]:
        """Every variant, the plain one first: each sampling kind with each set of options, and
        the pool kinds."""
        options = list(itertools.product((False, True), repeat=len(dataclasses.fields(cls)) - 1))
        return (
            *(cls(*o, kind=kind) for kind in cls.KINDS[:2] for o in options),
            *(cls(kind=k) for k in cls.KINDS[2:]),
        )

    @classmethod
    def for_pooling(cls, pooling_type: str) -> StepVariant:
        """A pooling model's every step: the pool kind, with every token's rows for ALL and STEP."""
        return cls(kind="pool_all" if pooling_type in TOKENWISE_TYPES else "pool")

    @classmethod
    def for_batch(cls, sched: SchedulerOutput) -> StepVariant:
        """The least a batch needs: an extra is on when some row of it asks for it."""
        # (C-level iteration over the rows: this runs every step, for hundreds of rows)
        needs = set(map(_EXTRAS, filter(None, map(_SAMPLING, sched.seqs))))
        return cls(
            with_processor_state=any(n[0] for n in needs),
            with_top_logprobs=any(n[1] for n in needs),
            with_prompt_logprobs=any(map(_PROMPT_TARGETS, sched.seqs)),
            with_token_bitmask=any(n[2] for n in needs),
            with_prompt_embeds=any(e is not None for e in map(_PROMPT_EMBEDS, sched.seqs)),
            kind="verify" if any(map(_NUM_DRAFTS, sched.seqs)) else "generate",
        )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepResult:
    """What a step hands back to the host, in one device->host copy. Device arrays when the
    step returns, numpy arrays after the copy; padding rows are computed too and dropped there."""

    tokens: jax.Array  # [logits rows] int32, the token sampled at each row (a row per sequence but to verify)
    logprobs: jax.Array  # [logits rows] float32, raw logprob of each sampled token
    # [logits rows]: the top-k and the sampled token's logprob and rank; with_top_logprobs only
    top: TopLogprobs[jax.Array] | None
    # [num_tokens] rows: at each fed token, the top-k and the logprob and rank of its successor
    # in the prompt (BatchInputs.prompt_targets); with_prompt_logprobs only
    prompt: TopLogprobs[jax.Array] | None
    # [num_seqs] int32, verify only: how many of each sequence's rows (from its first) are kept
    num_sampled: jax.Array | None = None
    # [num_seqs, 3, hidden] float32, the pool kinds only: per row, the sum of its fed tokens' final
    # hidden states, the one at its first fed token and the one at its last
    pooled: jax.Array | None = None
    # [num_tokens, hidden] float32, pool_all only: every fed token's final hidden state
    token_rows: jax.Array | None = None


def forward(
    state: nnx.State,
    kv_pool: jax.Array,  # [num_layers * pages_per_layer, 2 * num_kv_heads, page_size, head_dim], donated
    last_tokens: jax.Array,  # [largest seq bucket] int32, the previous step's sampled tokens
    inputs: BatchInputs | PackedBatch,
    *,
    graphdef: nnx.GraphDef,
    variant: StepVariant,
    num_top_logprobs: int,
) -> tuple[jax.Array, jax.Array, TopLogprobs[jax.Array] | None]:
    """The model over the batch: (kv_pool, the logits at the sampled rows, the prompt logprobs
    at every fed token for the prompt-logprobs variant, else None)."""
    inputs = unpacked(inputs)
    model = nnx.merge(graphdef, state)
    fed = jnp.where(inputs.feed_rows >= 0, last_tokens[jnp.maximum(inputs.feed_rows, 0)], inputs.input_ids)
    extra = {} if inputs.lora_slots is None else {"lora_slots": inputs.lora_slots}
    if variant.with_prompt_embeds:
        extra["input_embeds"] = inputs.input_embeds
    if inputs.rope_positions is not None:
        extra["rope_positions"] = inputs.rope_positions
    hidden, kv_pool = model.hidden_states(fed, inputs.positions, kv_pool, inputs.meta, **extra)
    logits = model.compute_logits(hidden[inputs.logits_indices])
    prompt = None
    if variant.with_prompt_logprobs:
        targets = jnp.maximum(inputs.prompt_targets, 0)
        prompt = prompt_logprobs(model.compute_logits, hidden, targets, num_top_logprobs)
    return kv_pool, logits, prompt


def prompt_logprobs(
    compute_logits: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,  # [num_tokens, hidden]
    targets: jax.Array,  # [num_tokens] int32, the token each row is ranked against
    k: int,
) -> TopLogprobs[jax.Array]:
    """The top-k and each target's logprob and rank at every row, PROMPT_CHUNK rows at a time:
    a long prefill's logits never exist whole ([8192, 128k] float32 is 4 GiB; a chunk is 256 MiB)."""
    n = hidden.shape[0]
    chunk = min(n, PROMPT_CHUNK)
    pad = -n % chunk
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, hidden.shape[-1])
    targets = jnp.pad(targets, (0, pad)).reshape(-1, chunk)

    def rows(chunk_of: tuple[jax.Array, jax.Array]) -> TopLogprobs[jax.Array]:
        h, t = chunk_of
        return top_logprobs(jax.nn.log_softmax(compute_logits(h), axis=-1), t, k)

    out = jax.lax.map(rows, (hidden, targets))
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:])[:n], out)


def sample_step(
    logits: jax.Array,  # forward's logits at the sampled rows
    processors: ProcessorState | None,  # given exactly when variant.with_processor_state; donated
    inputs: BatchInputs | PackedBatch,
    bitmask: jax.Array | None,  # [num_seqs, ceil(vocab / 32)] int32, given exactly when with_token_bitmask
    last_tokens: jax.Array,  # the previous step's, for their shape and sharding
    *,
    variant: StepVariant,
    num_top_logprobs: int,
) -> tuple[ProcessorState | None, jax.Array, StepResult]:
    """Sampling and the logprobs asked for, from forward's logits: (processor state, the sampled
    tokens padded like last_tokens, results; their prompt logprobs are forward's to fill in)."""
    inputs = unpacked(inputs)
    if bitmask is not None:
        if variant.kind == "verify":  # a sequence's mask on each of its rows
            bitmask = bitmask[_sequence_of_rows(inputs.cu_num_logits, logits.shape[0])]
        logits = apply_token_bitmask(logits, bitmask)
    k = num_top_logprobs if variant.with_top_logprobs else 0
    if variant.kind == "verify":
        return _verify(logits, processors, inputs, last_tokens, k)
    tokens, logprobs, top = sample(logits, inputs.sampling, processors, k)
    if processors is not None:
        processors = count_sampled(processors, inputs.sampling.processor_slot, tokens)
    sampled = jnp.zeros_like(last_tokens).at[: tokens.shape[0]].set(tokens)
    return processors, sampled, StepResult(tokens, logprobs, top, None)


def _sequence_of_rows(cu: jax.Array, rows: int) -> jax.Array:
    """[rows] the sequence each logits row belongs to (padding rows: the last sequence)."""
    return jnp.clip(jnp.searchsorted(cu, jnp.arange(rows), side="right") - 1, 0, cu.shape[0] - 2)


def _verify(
    logits: jax.Array,  # [logits rows, vocab]
    processors: ProcessorState | None,
    inputs: BatchInputs,  # in the verify layout
    last_tokens: jax.Array,
    k: int,
) -> tuple[ProcessorState | None, jax.Array, StepResult]:
    """Speculative decoding's check, exact for any sampling: each row samples as a step without
    proposals would at that output index (its own seed key; penalties counting the proposals
    before it), and a sequence keeps its rows up to and including the first whose sample differs
    from the proposal after it. A proposal is one token (a one-hot draft distribution q), and
    for such a q, rejection sampling (accept x with probability min(1, p(x) / q(x)), else draw
    from max(0, p - q) renormalised) is exactly this: draw from p and accept x when the draw is x.
    So every kept token has the target's distribution, and greedy rows keep the target's argmax."""
    cu, drafts = inputs.cu_num_logits, inputs.draft_tokens
    rows, num_seqs = drafts.shape[0], cu.shape[0] - 1
    seq_of = jnp.clip(jnp.searchsorted(cu, jnp.arange(rows), side="right") - 1, 0, num_seqs - 1)
    first_row = cu[seq_of]
    counts = None
    if processors is not None:  # a row's penalties count the proposals before it in its sequence
        onehot = (
            jnp.zeros((rows, logits.shape[-1]), jnp.int32).at[jnp.arange(rows), drafts].add(1, mode="drop")
        )
        before = jnp.cumsum(onehot, axis=0) - onehot
        counts = before - before[first_row]
    tokens, logprobs, top = sample(logits, inputs.sampling, processors, k, counts)
    mismatch = ((drafts >= 0) & (tokens != drafts)).astype(jnp.int32)
    earlier = jnp.cumsum(mismatch) - mismatch  # mismatches before each row, from the batch's first
    kept = (earlier == earlier[first_row]) & (jnp.arange(rows) < cu[-1])
    num_sampled = jax.ops.segment_sum(kept.astype(jnp.int32), seq_of, num_seqs)
    if processors is not None:
        slot = jnp.where(kept, inputs.sampling.processor_slot, -1)
        processors = count_sampled(processors, slot, tokens)
    last = tokens[jnp.maximum(cu[:-1] + num_sampled - 1, 0)]
    sampled = jnp.zeros_like(last_tokens).at[:num_seqs].set(last)
    return processors, sampled, StepResult(tokens, logprobs, top, None, num_sampled)


def pool(
    state: nnx.State,
    kv_pool: jax.Array,  # donated
    inputs: BatchInputs | PackedBatch,
    *,
    graphdef: nnx.GraphDef,
    all_rows: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """A pooling model's step: the layers over the batch (each prompt chunk's KV written for the
    chunks after it), then per row the sum of its tokens' final hidden states and those at its
    first and last token, float32 ([seq bucket, 3, hidden]), through the model's pooler head (a
    classifier's: [seq bucket, 3, num_labels]): all the host needs to finish a LAST, MEAN or CLS
    pooling over chunks of any size (jaxserve/pooling_params.py PooledSums); with `all_rows`, also
    every token's through the head ([num_tokens, hidden or labels], ALL and STEP pooling)."""
    inputs = unpacked(inputs)
    model = nnx.merge(graphdef, state)
    lora = {} if inputs.lora_slots is None else {"lora_slots": inputs.lora_slots}
    hidden, kv_pool = model.hidden_states(inputs.input_ids, inputs.positions, kv_pool, inputs.meta, **lora)
    hidden = model.final_hidden(hidden).astype(jnp.float32)
    cu = inputs.meta.cu_q_lens
    n, num_seqs = hidden.shape[0], cu.shape[0] - 1
    row_of = jnp.searchsorted(cu, jnp.arange(n), side="right") - 1  # padding tokens: num_seqs (dropped)
    total = jnp.zeros((num_seqs, hidden.shape[1]), jnp.float32).at[row_of].add(hidden, mode="drop")
    first = hidden[jnp.minimum(cu[:-1], n - 1)]
    last = hidden[jnp.maximum(cu[1:] - 1, 0)]
    rows = model.pooler_head(jnp.concatenate([total, first, last]))  # a classifier's logits
    tokens = model.pooler_head(hidden) if all_rows else None  # a reward model's rows per token
    return kv_pool, jnp.stack(jnp.split(rows, 3), axis=1), tokens


def step(
    state: nnx.State,
    kv_pool: jax.Array,  # donated
    processors: ProcessorState | None,  # given exactly when variant.with_processor_state; donated
    last_tokens: jax.Array,  # the previous step's sampled tokens
    inputs: BatchInputs | PackedBatch,
    *,
    graphdef: nnx.GraphDef,
    variant: StepVariant,
    num_top_logprobs: int,  # k of the top-k variants (the model's max_logprobs)
) -> tuple[jax.Array, ProcessorState | None, jax.Array, StepResult]:
    """One step, fused: (kv_pool, processor state, sampled tokens padded like last_tokens,
    results). The keyword arguments are static (bind them before jit); the rest are traced."""
    if variant.kind in ("pool", "pool_all"):
        all_rows = variant.kind == "pool_all"
        kv_pool, pooled, rows = pool(state, kv_pool, inputs, graphdef=graphdef, all_rows=all_rows)
        none = jnp.zeros(pooled.shape[0], jnp.int32)
        result = StepResult(none, none.astype(jnp.float32), None, None, None, pooled, rows)
        return kv_pool, processors, last_tokens, result
    kv_pool, logits, prompt = forward(
        state,
        kv_pool,
        last_tokens,
        inputs,
        graphdef=graphdef,
        variant=variant,
        num_top_logprobs=num_top_logprobs,
    )
    processors, sampled, result = sample_step(
        logits, processors, inputs, None, last_tokens, variant=variant, num_top_logprobs=num_top_logprobs
    )
    return kv_pool, processors, sampled, dataclasses.replace(result, prompt=prompt)
