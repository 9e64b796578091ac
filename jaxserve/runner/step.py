"""The device program of one step: the model's forward over a ragged token batch, logits at
the rows that need them, and sampling, all inside one jit.

ModelRunner compiles `step` once per shape bucket and variant. Everything the program depends
on is an argument: the arrays, and, bound before jit, the model graph, the variant and the
top-k width; the attention backend rides in the batch's AttentionMetadata as a static field.
The only context a trace reads is JAX's own mesh (jax.set_mesh, for layers that split work by
hand), which jit keys on too; so a compiled step is a function of what its cache key names.

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
from jaxserve.runner.batch import BatchInputs, PackedBatch, unpacked
from jaxserve.scheduler_output import SchedulerOutput, TopLogprobs

_SAMPLING, _PROMPT_TARGETS, _EXTRAS = map(attrgetter, ("sampling", "prompt_logprob_targets", "extras"))
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

    @classmethod
    def all(cls) -> tuple[StepVariant, ...]:
        """Every variant, the plain one first."""
        flags = itertools.product((False, True), repeat=len(dataclasses.fields(cls)))
        return tuple(cls(*f) for f in flags)

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
        )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepResult:
    """What a step hands back to the host, in one device->host copy. Device arrays when the
    step returns, numpy arrays after the copy; padding rows are computed too and dropped there."""

    tokens: jax.Array  # [num_seqs] int32, the token sampled for each sequence row
    logprobs: jax.Array  # [num_seqs] float32, raw logprob of each sampled token
    # [num_seqs] rows: the top-k and the sampled token's logprob and rank; with_top_logprobs only
    top: TopLogprobs[jax.Array] | None
    # [num_tokens] rows: at each fed token, the top-k and the logprob and rank of its successor
    # in the prompt (BatchInputs.prompt_targets); with_prompt_logprobs only
    prompt: TopLogprobs[jax.Array] | None


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
    lora = {} if inputs.lora_slots is None else {"lora_slots": inputs.lora_slots}
    hidden, kv_pool = model.hidden_states(fed, inputs.positions, kv_pool, inputs.meta, **lora)
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
        logits = apply_token_bitmask(logits, bitmask)
    k = num_top_logprobs if variant.with_top_logprobs else 0
    tokens, logprobs, top = sample(logits, inputs.sampling, processors, k)
    if processors is not None:
        processors = count_sampled(processors, inputs.sampling.processor_slot, tokens)
    sampled = jnp.zeros_like(last_tokens).at[: tokens.shape[0]].set(tokens)
    return processors, sampled, StepResult(tokens, logprobs, top, None)


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
