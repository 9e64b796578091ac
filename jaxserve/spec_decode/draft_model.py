"""Proposals from a draft model: a smaller model of the target's vocabulary, run on the target's
mesh, proposes each decoding request's next k tokens greedily; the target's verify step keeps
those its own sampling agrees with (runner/step.py), so outputs are the target's either way.

The draft has a KV pool of its own with as many pages as the target's and the same page size, and
reads each request's pages through the target's page table: the scheduler gives a request the
pages of its proposals before asking for them, so the draft's writes land in pages the request
owns (positions past them, when a row takes fewer than num_speculative_tokens, land in page 0,
which is never handed out). The draft remembers how many of a request's
tokens its cache holds; each call feeds it the rest (the tokens the target kept since, or a
whole prompt the first time), then runs k - 1 one-token steps in one jitted loop: one device
call per engine step for all requests, not k host round trips. A call whose tokens exceed the
largest bucket feeds the oldest first, over several calls. The program of every bucket compiles
at start-up (on use under enforce_eager).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import EngineConfig
from jaxserve.runner import batch as batch_lib
from jaxserve.runner.step_programs import abstract
from jaxserve.scheduler_output import ScheduledSeq, SchedulerOutput


def draft_engine_config(config: EngineConfig, num_blocks: int, page_size: int) -> EngineConfig:
    """The draft's configuration: its model (resolved at start-up, args_to_config), with the
    target's shapes, page size and page count; no LoRA, no proposals of its own, compiled on use."""
    return dataclasses.replace(
        config,
        model_config=config.speculative_config.draft_model_config,
        cache_config=dataclasses.replace(
            config.cache_config,
            block_size=page_size,
            num_gpu_blocks_override=num_blocks,
            cache_dtype="auto",
            quantization_param_path=None,
            calculate_kv_scales=False,
        ),
        compilation_config=dataclasses.replace(config.compilation_config, enforce_eager=True),
        lora_config=None,
        speculative_config=None,
    )


def draft_step(
    state: nnx.State,
    kv_pool: jax.Array,  # donated
    inputs: batch_lib.PackedBatch,
    *,
    graphdef: nnx.GraphDef,
    k: int,
    pad_slot: int,
) -> tuple[jax.Array, jax.Array]:
    """The draft over the batch's new tokens, then k - 1 greedy one-token steps per sequence:
    (kv_pool, [seq bucket, k] int32 proposals; padding sequences' rows are garbage)."""
    inputs = batch_lib.unpacked(inputs)
    model = nnx.merge(graphdef, state)
    meta = inputs.meta
    hidden, kv_pool = model.hidden_states(inputs.input_ids, inputs.positions, kv_pool, meta)

    def greedy(h):
        return jnp.argmax(model.compute_logits(h), axis=-1).astype(jnp.int32)

    token = greedy(hidden[inputs.logits_indices])  # [S]
    seqs = token.shape[0]
    page_size, pages_per_seq = kv_pool.shape[2], meta.page_indices.shape[1]
    live = jnp.arange(seqs) < meta.num_seqs[0]
    cu = jnp.minimum(jnp.arange(seqs + 1, dtype=jnp.int32), meta.num_seqs[0])
    first = meta.kv_lens  # each sequence's next position

    def one_token(i, carry):
        pool, token, out = carry
        pos = first + i
        page = pos // page_size
        inside = live & (page < pages_per_seq)
        ids = meta.page_indices[jnp.arange(seqs), jnp.minimum(page, pages_per_seq - 1)]
        slot = jnp.where(inside, ids * page_size + pos % page_size, pad_slot)
        step_meta = dataclasses.replace(
            meta, slot_mapping=slot, kv_lens=jnp.where(inside, pos + 1, 0), cu_q_lens=cu
        )
        hidden, pool = model.hidden_states(token, pos, pool, step_meta)
        token = greedy(hidden)
        return pool, token, out.at[:, i + 1].set(token)

    out = jnp.zeros((seqs, k), jnp.int32).at[:, 0].set(token)
    kv_pool, _, out = jax.lax.fori_loop(0, k - 1, one_token, (kv_pool, token, out))
    return kv_pool, out


def draft_program(graphdef: nnx.GraphDef, k: int, pad_slot: int):
    """draft_step jitted for a draft's graph, k proposals a row, its pool's pad slot."""
    return jax.jit(
        functools.partial(draft_step, graphdef=graphdef, k=k, pad_slot=pad_slot), donate_argnums=(1,)
    )


def compile_draft(program, state, kv_pool, layout, bucket: tuple[int, int], mesh) -> jax.stages.Compiled:
    """The draft program of one bucket, from the shapes and shardings of its arrays alone (real
    ones, or abstract ones for devices this process only compiles for)."""
    empty = batch_lib.PackedBatch.pack(layout.prepare(SchedulerOutput(seqs=()), bucket))
    args = (abstract(state), abstract(kv_pool), abstract(empty, NamedSharding(mesh, PartitionSpec())))
    with jax.set_mesh(mesh):  # layers that split work by hand read the mesh
        return program.lower(*args).compile()


class DraftModelProposer:
    """The scheduler's proposer for method "draft_model": proposes for many requests at once
    (propose_many), on pages the scheduler gave the requests first (needs_pages)."""

    needs_pages = True

    @classmethod
    def of(cls, config: EngineConfig, target_runner) -> DraftModelProposer | None:
        """The proposer of an engine whose speculative method is draft_model, else None."""
        spec = config.speculative_config
        return cls(config, target_runner) if spec is not None and spec.method == "draft_model" else None

    def __init__(self, config: EngineConfig, target_runner):
        from jaxserve.runner.model_runner import ModelRunner

        self.k = config.speculative_config.num_speculative_tokens
        draft_config = draft_engine_config(config, target_runner.num_blocks, target_runner.page_size)
        # (its vocabulary was checked against the target's at start-up: args_to_config)
        self.runner = ModelRunner(draft_config, target_runner.mesh, step_cache=target_runner.step_cache)
        self.layout = self.runner.layout
        # each request's tokens in the draft's cache, and the pages they are in (pages that
        # changed since, as after a preemption, hold none of them)
        self.cached: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._program = draft_program(self.runner.graphdef, self.k, self.layout.pad_slot)
        self._compiled: dict[tuple[int, int], jax.stages.Compiled] = {}
        self.replicated = NamedSharding(self.runner.mesh, PartitionSpec())
        if not config.compilation_config.enforce_eager:  # no request compiles (the target's rule)
            for bucket in self.layout.buckets.all():
                self._compile(bucket)

    def propose_many(
        self, rows: Sequence[tuple[str, Sequence[int], Sequence[int], int]]
    ) -> dict[str, list[int]]:
        """Up to k proposals for each (request id, its tokens, its page table, k) whose tokens the
        draft could take in; the others get none this step. (The loop runs num_speculative_tokens
        steps for every row; positions past a row's pages are written to page 0, never handed out.)"""
        largest = self.layout.buckets.tokens[-1]
        most_seqs = self.layout.buckets.seqs[-1]
        proposals: dict[str, list[int]] = {}
        wanted = {row[0]: row[3] for row in rows}
        pending = [row[:3] for row in rows]
        while pending:
            seqs, budget, rest = [], largest, []
            for request_id, tokens, pages in pending:
                start = min(self._cached_tokens(request_id, pages), len(tokens) - 1)
                n = min(len(tokens) - start, budget)
                if n <= 0 or len(seqs) == most_seqs:
                    rest.append((request_id, tokens, pages))
                    continue
                seqs.append(
                    ScheduledSeq(request_id, tuple(tokens[start : start + n]), start, tuple(pages), None)
                )
                budget -= n
                if start + n < len(tokens):
                    rest.append((request_id, tokens, pages))
            if not seqs:
                break
            out = self._run(SchedulerOutput(seqs=tuple(seqs)))
            for i, seq in enumerate(seqs):
                n = seq.start_pos + seq.num_new
                self.cached[seq.request_id] = (n, seq.block_ids[: -(-n // self.runner.page_size)])
                if all(seq.request_id != r[0] for r in rest):
                    proposals[seq.request_id] = out[i, : wanted[seq.request_id]].tolist()
            pending = rest
        return proposals

    def _cached_tokens(self, request_id: str, pages: Sequence[int]) -> int:
        n, held = self.cached.get(request_id, (0, ()))
        return n if tuple(pages[: len(held)]) == held else 0

    def _compile(self, bucket: tuple[int, int]) -> jax.stages.Compiled:
        compiled = self._compiled.get(bucket)
        if compiled is None:
            runner = self.runner
            compiled = compile_draft(
                self._program, runner.state, runner.kv_pool, self.layout, bucket, runner.mesh
            )
            self._compiled[bucket] = compiled
        return compiled

    def _run(self, sched: SchedulerOutput):
        bucket = self.layout.buckets.pick(sched.num_tokens, len(sched.seqs))
        inputs = jax.device_put(
            batch_lib.PackedBatch.pack(self.layout.prepare(sched, bucket)), self.replicated
        )
        self.runner.kv_pool, out = self._compile(bucket)(self.runner.state, self.runner.kv_pool, inputs)
        return jax.device_get(out)

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.cached.pop(request_id, None)

    def sleep(self, level: int) -> int:
        """The engine sleeps: the draft's weights and pool go too (bytes freed); its cache of
        every request is gone."""
        self.cached.clear()
        return self.runner.sleep(level)

    def wake_up(self, tags) -> None:
        self.runner.wake_up(tags)
