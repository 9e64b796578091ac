"""The compiled step programs of one model on one mesh, built from shapes alone.

Where it sits: ModelRunner owns one and asks it for the program of a (bucket, variant) before a
step runs (runner/step.py is what gets compiled). It needs no weights and no KV pool, only their
abstract arrays (shapes, dtypes, shardings), so the same object compiles the server's programs
for devices this process cannot run on: the TPU compile check (jaxserve/aot/) builds one over a
TPU topology's devices from the model's configuration, and compiles exactly what a server on
that TPU would.

A program is looked up in the StepCache (step_cache.py, shared in memory), then in the
executable store (executable_cache.py, on disk) when there is one, and only then traced,
lowered and compiled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.chips import ridge_tokens
from jaxserve.config import EngineConfig
from jaxserve.layers import pipeline
from jaxserve.layers.attention import pool_head_dim
from jaxserve.layers.sampler import ProcessorState
from jaxserve.loader.model_loader import abstract_model, build_model_args
from jaxserve.models.causal_lm import InputEmbeds
from jaxserve.prompt_embeds import embedding_width
from jaxserve.runner import batch as batch_lib
from jaxserve.runner import kv_scales
from jaxserve.runner.bucketing import Buckets
from jaxserve.runner.executable_cache import ExecutableCache
from jaxserve.runner.kv_cache import KVCacheSpec, abstract_kv_pool, num_blocks_for
from jaxserve.runner.step import StepVariant, forward, sample_step, step
from jaxserve.runner.step_cache import StepCache
from jaxserve.scheduler_output import SchedulerOutput
from jaxserve.sharding import per_device_bytes
from pallas_kernels.ragged_paged_attention.reference import is_quantized

Bucket = tuple[int, int]  # (token bucket, sequence bucket)


@dataclass(frozen=True)
class StepLayout:
    """What shapes a model's steps on a mesh: the KV pool and its pages, the buckets, the widths
    of the sampler's outputs. Settled once, from the configuration and the memory the devices
    have (runner/kv_cache.py), before anything is compiled."""

    attention_backend: str
    kv_spec: KVCacheSpec
    num_blocks: int  # blocks of the pool (block 0 is never handed out)
    pages_per_seq: int
    buckets: Buckets
    num_slots: int  # logit-processing slots: one per running request at most
    num_top_logprobs: int  # k of the top-k variants (the model's max_logprobs)
    kv_scales: np.ndarray | None  # [num_layers, 2] a quantized pool's initial scales
    with_lora: bool  # the model has LoRA slots
    num_speculative_tokens: int = 0  # most proposed tokens a sequence is fed (the verify layout)
    embeds_width: int = 0  # the rows of prompts given as embeddings (0: the engine takes none)
    mrope: bool = False  # the model's rope takes three positions a token (M-RoPE)
    microbatch_tokens: int = 0  # under a pipeline (AttentionMetadata.microbatch_tokens)

    @classmethod
    def plan(cls, config: EngineConfig, args, mesh, with_lora: bool, memory_stats=None) -> StepLayout:
        """`memory_stats`: each device's (bytes_limit, bytes_in_use) when they are not the mesh's own
        devices' (the TPU compile check)."""
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        backend = config.compilation_config.attention_backend
        encoder = getattr(args, "bidirectional", False)  # keeps no KV: its pages are only counted
        spec = KVCacheSpec(
            num_layers=1 if encoder else args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_dim=1 if encoder else pool_head_dim(backend, args.head_dim),
            page_size=cc.block_size,
            dtype=jnp.dtype(cc.kv_pool_dtype(mc.dtype)),
        )
        scales = None
        if is_quantized(spec.dtype):
            platform = mesh.devices.flat[0].platform
            scales = kv_scales.initial_scales(config, args.num_layers, spec.dtype.name, platform)
        pages_per_seq = -(-sc.max_model_len // spec.page_size)
        # a pooling engine plans a step while the last one's requests (ended, but not yet told so)
        # still hold their pages: room for two steps' worth of requests
        seqs = sc.max_num_seqs * (2 if mc.runner_type == "pooling" else 1)
        max_useful = seqs * pages_per_seq + 1
        shared = draft_footprint(config, mesh, spec.page_size)
        return cls(
            attention_backend=backend,
            kv_spec=spec,
            num_blocks=num_blocks_for(spec, cc, max_useful, mesh, memory_stats, shared),
            pages_per_seq=pages_per_seq,
            buckets=Buckets.from_config(sc, config.compilation_config),
            num_slots=sc.max_num_seqs,
            num_top_logprobs=args.vocab_size if mc.max_logprobs < 0 else max(mc.max_logprobs, 1),
            kv_scales=scales,
            with_lora=with_lora,
            num_speculative_tokens=config.speculative_config.num_speculative_tokens
            if config.speculative_config
            else 0,
            embeds_width=embedding_width(mc.hf_config) if mc.enable_prompt_embeds or mc.is_multimodal else 0,
            mrope=bool(getattr(args, "mrope_rows", ())),
            microbatch_tokens=microbatch_tokens(config, mesh),
        )

    @property
    def pad_slot(self) -> int:
        """A slot index past the KV pool: padding tokens write there, and the write is dropped."""
        return self.num_blocks * self.kv_spec.num_layers * self.kv_spec.page_size

    def prepare(
        self, sched: SchedulerOutput, bucket: Bucket, kv_scales=None, verify: bool = False
    ) -> batch_lib.BatchInputs:
        """A step's host arrays in this layout (kv_scales: the pool's current ones, if measured;
        verify: the layout of a step with proposed tokens)."""
        return batch_lib.prepare(
            sched,
            *bucket,
            self.kv_spec.page_size,
            self.pages_per_seq,
            self.pad_slot,
            self.attention_backend,
            self.kv_scales if kv_scales is None else kv_scales,
            self.with_lora,
            self.num_speculative_tokens + 1 if verify else 1,
            self.mrope,
            self.microbatch_tokens,
        )


def microbatch_tokens(config: EngineConfig, mesh) -> int:
    """The rows below which a pipeline microbatch costs a stage its weights' read time (0 without
    stages: no microbatches): the configured count, else the chip's ridge point, else 256 (about
    a v5e's; CPUs and GPUs)."""
    if config.parallel_config.pipeline_parallel_size == 1:
        return 0
    configured = config.compilation_config.pipeline_microbatch_tokens
    if configured is not None:
        return configured
    return ridge_tokens(mesh.devices.flat[0].device_kind) or 256


def draft_footprint(config: EngineConfig, mesh, page_size: int) -> tuple[int, int]:
    """What a draft model (speculative method draft_model) will take beside the target, to plan
    the target's pool with: (its pool's bytes per block, pages of `page_size` in every layer; its
    weights' bytes on the fullest device). (0, 0) without one."""
    spec = config.speculative_config
    if spec is None or spec.draft_model_config is None:
        return 0, 0
    mc = spec.draft_model_config
    _, args = build_model_args(mc, config.parallel_config)
    head_dim = pool_head_dim(config.compilation_config.attention_backend, args.head_dim)
    kv = KVCacheSpec(args.num_layers, args.num_kv_heads, head_dim, page_size, jnp.dtype(mc.dtype))
    _, state = abstract_model(mc, mesh, config.parallel_config)
    return kv.bytes_per_block, per_device_bytes(state)


def abstract(tree, sharding=None):
    """Shapes, dtypes and shardings only: what lowering needs, safe to read from another thread
    while the engine donates the real arrays."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding), tree
    )


class StepPrograms:
    def __init__(
        self,
        graphdef: nnx.GraphDef,
        state: nnx.State,  # abstract: ShapeDtypeStructs with the weights' shardings
        mesh: jax.sharding.Mesh,
        layout: StepLayout,
        *,
        vocab_size: int,
        step_cache: StepCache,
        executables: ExecutableCache | None = None,
        stored_as: tuple = (),  # what names the model in the executable store's keys
    ):
        self.graphdef, self.state, self.mesh, self.layout = graphdef, state, mesh, layout
        self.kv_pool = abstract_kv_pool(layout.kv_spec, layout.num_blocks, mesh)
        self.step_cache, self.executables, self.stored_as = step_cache, executables, stored_as
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.mask_words = (vocab_size + 31) // 32  # int32 words of one row's token mask
        self.processors = ProcessorState(
            *(jax.ShapeDtypeStruct((layout.num_slots, vocab_size), t, sharding=self.replicated)
              for t in (jnp.bool_, jnp.int32, jnp.float32))
        )  # fmt: skip
        largest = layout.buckets.seqs[-1]
        self.last_tokens = jax.ShapeDtypeStruct((largest,), jnp.int32, sharding=self.replicated)
        # Device programs by (part, variant): the fused step, or forward + sample_step
        self.programs = {}
        k, g = layout.num_top_logprobs, graphdef
        for v in StepVariant.all():
            if v.with_token_bitmask:
                self.programs["forward", v] = jax.jit(
                    partial(forward, graphdef=g, variant=v, num_top_logprobs=k), donate_argnums=(1,)
                )
                self.programs["sample", v] = jax.jit(
                    partial(sample_step, variant=v, num_top_logprobs=k), donate_argnums=(1,)
                )
            else:
                self.programs["step", v] = jax.jit(
                    partial(step, graphdef=g, variant=v, num_top_logprobs=k), donate_argnums=(1, 2)
                )
        # the compiled programs by (bucket, variant): found without building a StepCache key
        self.compiled: dict[tuple[Bucket, StepVariant], jax.stages.Compiled | tuple] = {}

    def compile(self, bucket: Bucket, variant: StepVariant = StepVariant()):
        """The compiled step of a bucket and variant: one program, or (forward, sample_step) for a
        variant with a token mask."""
        compiled = self.compiled.get((bucket, variant))
        if compiled is None:
            empty = self.layout.prepare(SchedulerOutput(seqs=()), bucket, verify=variant.kind == "verify")
            if variant.with_prompt_embeds:
                rows = np.zeros((bucket[0], self.layout.embeds_width), np.float32)
                empty = dataclasses.replace(
                    empty, input_embeds=InputEmbeds(rows, np.zeros(bucket[0], np.int32))
                )
            inputs = abstract(batch_lib.PackedBatch.pack(empty), self.replicated)
            processors = self.processors if variant.with_processor_state else None
            last = self.last_tokens
            if not variant.with_token_bitmask:
                compiled = self._build("step", variant, (self.state, self.kv_pool, processors, last, inputs))
            else:
                fwd_args = (self.state, self.kv_pool, last, inputs)
                # the forward pass reads no sampling option: variants that differ in those alone
                # share one program (per input shapes, which tell the kinds apart)
                fwd_variant = StepVariant(
                    with_prompt_logprobs=variant.with_prompt_logprobs,
                    with_token_bitmask=True,
                    with_prompt_embeds=variant.with_prompt_embeds,
                )
                fwd = self._build("forward", fwd_variant, fwd_args)
                with jax.set_mesh(self.mesh):
                    logits = jax.eval_shape(self.programs["forward", fwd_variant], *fwd_args)[1]
                logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=fwd.output_shardings[1])
                bitmask = jax.ShapeDtypeStruct(
                    (bucket[1], self.mask_words), jnp.int32, sharding=self.replicated
                )
                compiled = (fwd, self._build("sample", variant, (logits, processors, inputs, bitmask, last)))
            self.compiled[(bucket, variant)] = compiled
        return compiled

    def _build(self, part: str, variant: StepVariant, args: tuple) -> jax.stages.Compiled:
        # A program is a function of the graph, the part and variant, the top-k width, the
        # attention backend (also in the inputs' tree structure, as a static field, as the pipeline's
        # microbatch rows are) and whether a pipeline timeline is being recorded; the arrays'
        # shapes, dtypes and shardings settle the rest.
        key = (self.graphdef, part, variant, self.layout.num_top_logprobs, self.layout.attention_backend,
               pipeline.recording(), jax.tree.structure(args),
               tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(args)))  # fmt: skip
        return self.step_cache.get_or_build(key, lambda: self._load_or_compile(key, part, variant, args))

    def _load_or_compile(
        self, key: tuple, part: str, variant: StepVariant, args: tuple
    ) -> jax.stages.Compiled:
        """The program from the executable store when an earlier start compiled it, else traced,
        lowered and compiled now (and stored)."""
        if self.executables is None:
            return self._trace_and_compile(part, variant, args)
        devices = list(self.mesh.devices.flat)
        # the graph is the model class applied to its arguments; the rest of the key as text
        stored_as = (*self.stored_as, *map(str, key[1:]), tuple((d.id, d.device_kind) for d in devices))
        compiled = self.executables.load(stored_as, devices)
        if compiled is None:
            compiled = self._trace_and_compile(part, variant, args)
            self.executables.store(stored_as, compiled)
        return compiled

    def _trace_and_compile(self, part: str, variant: StepVariant, args: tuple) -> jax.stages.Compiled:
        # layers that split work by hand (MoE experts, the attention kernels) read the mesh
        with jax.set_mesh(self.mesh):
            return self.programs[part, variant].lower(*args).compile()
