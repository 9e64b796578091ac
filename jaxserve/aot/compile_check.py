"""Compile a server's step programs for a TPU slice this host does not have, and check they fit.

The configuration is the one `jaxserve serve` would build on that slice (EngineArgs with the
slice's devices as the platform's: model_resolution.targeting), the model its abstract arrays with
the engine's shardings (loader.abstract_model: no weight is read), the KV pool sized by the engine's
own rule for the chip's HBM (StepLayout.plan), and the programs the runner's own StepPrograms,
compiled by libtpu. Each compiled program reports XLA's memory analysis and cost analysis.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.aot.chips import Target, pallas_target
from jaxserve.args import EngineArgs
from jaxserve.loader.model_loader import abstract_model, build_model_args
from jaxserve.model_resolution import targeting
from jaxserve.models.registry import resolve_architecture
from jaxserve.runner.bucketing import Buckets
from jaxserve.runner.image_encoder import image_call_program
from jaxserve.runner.kv_cache import abstract_kv_pool, devices_per_block
from jaxserve.runner.step import StepVariant
from jaxserve.runner.step_cache import StepCache
from jaxserve.runner.step_programs import StepLayout, StepPrograms
from jaxserve.sharding import make_mesh, per_device_bytes
from jaxserve.spec_decode.draft_model import compile_draft, draft_engine_config, draft_program


@dataclass
class Program:
    """One compiled program: a (bucket, variant) and, for a variant with a token mask, the part
    (forward or sample: two programs)."""

    bucket: tuple[int, int]
    variant: str
    part: str
    seconds: float = 0.0
    error: str | None = None
    argument_bytes: int = 0  # XLA's memory analysis, per device
    output_bytes: int = 0
    alias_bytes: int = 0  # outputs written in place of donated arguments (the KV pool)
    temp_bytes: int = 0
    code_bytes: int = 0
    resident_bytes: int = 0  # what stays on the device outside this program's arguments
    # XLA's cost analysis: blind inside a Pallas kernel, and it counts the layer loop's body once
    flops: float = 0.0
    bytes_accessed: float = 0.0
    kernels: int = 0  # Pallas (Mosaic) kernels in the program

    @property
    def peak_bytes(self) -> int:
        """The most this program's device holds while it runs."""
        live = self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
        return live + self.code_bytes + self.resident_bytes


@dataclass
class Report:
    model: str
    target: str
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1
    pipeline_microbatch_tokens: int = 0  # under a pipeline, the ridge rows microbatches are chosen by
    dtype: str = ""
    quantization: str | None = None
    kv_cache_dtype: str = ""
    attention_backend: str = ""
    hbm_bytes: int = 0  # what one program may use on one chip
    gpu_memory_utilization: float = 0.0
    weight_bytes: int = 0  # per device (the fullest)
    kv_pool_bytes: int = 0  # per device, as the engine would allocate it
    num_blocks: int = 0
    page_size: int = 0
    kv_tokens: int = 0
    max_model_len: int = 0
    max_loras: int = 0  # LoRA adapter slots (--enable-lora --max-loras); 0 without LoRA
    draft_weight_bytes: int = 0  # a draft model's (speculative method draft_model), per device
    draft_kv_pool_bytes: int = 0  # its pool, as many blocks as the target's, per device
    shape: dict = field(default_factory=dict)  # what the roofline needs (aot/roofline.py)
    weights: dict = field(default_factory=dict)  # per-device bytes and elements by role (weight_roles)
    buckets: list = field(default_factory=list)
    programs: list[Program] = field(default_factory=list)
    refused: str | None = None  # the engine refused the configuration (one line)

    @property
    def layout(self) -> str:
        pp = self.pipeline_parallel_size
        return f"tp={self.tensor_parallel_size}" + (f" pp={pp}" if pp > 1 else "")

    @property
    def peak_bytes(self) -> int:
        return max((p.peak_bytes for p in self.programs if p.error is None), default=0)

    def failures(self) -> list[str]:
        """One line per problem; none when every program compiled and fits."""
        where = f"{self.model} on {self.target} {self.layout}"
        if self.refused:
            return [f"{where}: {self.refused}"]
        lines = []
        for p in self.programs:
            name = f"{where} bucket {p.bucket} {p.variant} {p.part}"
            if p.error:
                lines.append(f"{name}: did not compile: {p.error}")
            elif p.peak_bytes > self.hbm_bytes:
                lines.append(
                    f"{name}: needs {p.peak_bytes / 2**30:.2f} GiB of the chip's "
                    f"{self.hbm_bytes / 2**30:.2f} GiB"
                )
            elif p.part not in ("sample", "encoder") and p.kernels == 0 and self.attention_backend == "tpu":
                # (an image encoder attends within one image, densely: no paged kernel there)
                lines.append(f"{name}: compiled without the Pallas attention kernel")
        return lines

    @classmethod
    def from_dict(cls, raw: dict) -> Report:
        """A report back from its as_dict() (JSON) form."""
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        fields["buckets"] = [tuple(b) for b in raw.get("buckets", ())]
        fields["programs"] = [
            Program(
                **{**{k: p[k] for k in Program.__dataclass_fields__ if k in p}, "bucket": tuple(p["bucket"])}
            )
            for p in raw.get("programs", ())
        ]
        return cls(**fields)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["peak_bytes"] = self.peak_bytes
        for program, raw in zip(self.programs, out["programs"]):
            raw["peak_bytes"] = program.peak_bytes
        return out


def programs_in_scope(
    buckets: Buckets,
    scope: str,
    speculative: bool = False,
    pooling: str | None = None,
    prompt_embeds: bool = False,
) -> list[tuple[tuple[int, int], StepVariant]]:
    """The (bucket, variant) pairs to compile, smallest bucket first; the verify kind's only for
    an engine with speculative decoding (`speculative`), the prompt-embeddings variants only for
    one that takes them (`prompt_embeds`): all that ever runs them; a pooling model's engine runs
    its pool kind alone (`pooling`: "pool" or "pool_all")."""
    every = buckets.all()
    variants = [
        v
        for v in StepVariant.all()
        if (speculative or v.kind == "generate") and (prompt_embeds or not v.with_prompt_embeds)
    ]
    if pooling:
        variants = [StepVariant(kind=pooling)]
    ends = [every[0], every[-1]] if len(every) > 1 else every
    if scope == "all":
        return [(b, v) for b in every for v in variants]
    if scope == "quick":  # and the smallest verify program, and prompt-embeddings one, where run
        verify = [(every[0], v) for v in variants if v.kind == "verify"][:1]
        embeds = [(every[0], v) for v in variants if v.with_prompt_embeds][:1]
        return [(b, variants[0]) for b in ends] + verify + embeds
    plain = [(b, variants[0]) for b in every]
    if scope == "plain":
        return plain
    return plain + [(b, v) for b in ends for v in variants[1:]]


def variant_name(variant: StepVariant) -> str:
    on = [
        f.name.removeprefix("with_") for f in dataclasses.fields(variant) if getattr(variant, f.name) is True
    ]
    if variant.kind != "generate":
        on.insert(0, variant.kind)
    return "+".join(on) or "plain"


def weight_roles(state) -> dict:
    """Per-device bytes and matrix elements of the weights by what a step does with them: the
    embedding table (rows gathered; also the head when there is no lm_head), the head, the experts
    (a token uses top_k of them), the LoRA adapters' slots (a token uses its own adapter's) and the
    rest of the layers (every token uses all of them)."""
    flat = {"/".join(map(str, k)): v.value for k, v in nnx.to_flat_state(state)}
    tied = "lm_head" not in flat
    roles = {r: {"bytes": 0, "elements": 0} for r in ("embedding", "head", "experts", "lora", "dense")}
    for name, x in flat.items():
        shard = x.sharding.shard_shape(x.shape)
        leaf = name.rsplit("/", 1)[-1]
        if name.startswith("embed_tokens"):
            role = "head" if tied else "embedding"
        elif name.startswith("lm_head"):
            role = "head"
        elif "_lora_" in leaf:
            role = "lora"
        else:
            role = "experts" if leaf.startswith("expert") else "dense"
        roles[role]["bytes"] += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
        if len(shard) >= 2 and not leaf.endswith(("_scale", "norm")):  # a matrix a matmul reads
            roles[role]["elements"] += int(np.prod(shard))
    return roles


def check(
    engine_args: EngineArgs,
    target: Target,
    scope: str = "default",
    progress: Callable[[Program], None] | None = None,
) -> Report:
    """Compile the server's step programs for `target` and measure them (no weight is read)."""
    devices = target.devices()
    engine_args = dataclasses.replace(engine_args, load_format="dummy")
    report = Report(
        str(engine_args.model or "default model"),
        target.name,
        engine_args.tensor_parallel_size,
        engine_args.pipeline_parallel_size,
    )
    try:
        with targeting(devices):
            config = engine_args.create_engine_config()
    except ValueError as err:
        report.refused = str(err).splitlines()[0]
        return report
    pc, mc, cc = config.parallel_config, config.model_config, config.cache_config
    mesh = make_mesh(pc.tensor_parallel_size, pc.data_parallel_size, devices, pc.pipeline_parallel_size)
    try:
        graphdef, state = abstract_model(mc, mesh, pc, config.lora_config)
    except ValueError as err:  # weights that do not split over this tensor parallel size
        report.refused = str(err).splitlines()[0]
        return report
    _, args = build_model_args(mc, pc, config.lora_config)
    chip = target.chip
    report.weights = weight_roles(state)
    report.weight_bytes = sum(role["bytes"] for role in report.weights.values())
    memory = [{"bytes_limit": chip.hbm_bytes, "bytes_in_use": report.weight_bytes}] * mesh.size
    try:
        layout = StepLayout.plan(config, args, mesh, config.lora_config is not None, memory)
    except ValueError as err:  # no room for the KV pool
        report.refused = str(err).splitlines()[0] + _larger_slice(
            report, config.cache_config.gpu_memory_utilization
        )
        return report
    steps = StepPrograms(graphdef, state, mesh, layout, vocab_size=args.vocab_size, step_cache=StepCache())
    report.dtype, report.quantization = str(mc.dtype), mc.quantization
    report.kv_cache_dtype, report.attention_backend = str(layout.kv_spec.dtype), layout.attention_backend
    report.hbm_bytes, report.gpu_memory_utilization = chip.hbm_bytes, cc.gpu_memory_utilization
    report.kv_pool_bytes = per_device_bytes(steps.kv_pool)
    report.num_blocks, report.page_size = layout.num_blocks, layout.kv_spec.page_size
    report.kv_tokens = (layout.num_blocks - 1) * layout.kv_spec.page_size
    report.max_model_len = config.scheduler_config.max_model_len
    report.max_loras = config.lora_config.max_loras if config.lora_config else 0
    report.buckets = layout.buckets.all()
    report.pipeline_microbatch_tokens = layout.microbatch_tokens
    spec = layout.kv_spec
    report.shape = {
        "num_layers": args.num_layers,
        "num_heads": args.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": args.head_dim,
        "kv_bytes_per_token": spec.bytes_per_block / spec.page_size / devices_per_block(mesh),
        "num_experts": args.moe.num_experts if getattr(args, "moe", None) else 0,
        "top_k": args.moe.top_k if getattr(args, "moe", None) else 0,
    }
    resident = report.weight_bytes + report.kv_pool_bytes  # held while a sample program runs
    with pallas_target(chip):
        pooler = mc.pooler_config
        pooling = None if pooler is None else StepVariant.for_pooling(pooler.pooling_type).kind
        for bucket, variant in programs_in_scope(
            layout.buckets,
            scope,
            layout.num_speculative_tokens > 0,
            pooling,
            mc.enable_prompt_embeds or mc.is_multimodal,  # (a prompt's image rows go in as embeddings)
        ):
            for program in _compile(steps, bucket, variant, resident):
                report.programs.append(program)
                if progress is not None:
                    progress(program)
        for program in _encoder_programs(config, graphdef, state, mesh, args, scope, resident):
            report.programs.append(program)
            if progress is not None:
                progress(program)
        for program in _draft_programs(config, layout, mesh, scope, report):
            report.programs.append(program)
            if progress is not None:
                progress(program)
    return report


def _draft_programs(config, layout: StepLayout, mesh, scope: str, report: Report) -> list[Program]:
    """A draft model's program (speculative method draft_model) at the smallest bucket (`quick`)
    or the smallest and largest, compiled and measured beside the target's weights and pool; the
    draft's own bytes in the report."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return []
    draft = draft_engine_config(config, layout.num_blocks, layout.kv_spec.page_size)
    mc, pc = draft.model_config, draft.parallel_config
    graphdef, state = abstract_model(mc, mesh, pc)
    draft_layout = StepLayout.plan(draft, build_model_args(mc, pc)[1], mesh, False)
    pool = abstract_kv_pool(draft_layout.kv_spec, draft_layout.num_blocks, mesh)
    report.draft_weight_bytes, report.draft_kv_pool_bytes = per_device_bytes(state), per_device_bytes(pool)
    program = draft_program(graphdef, spec.num_speculative_tokens, draft_layout.pad_slot)
    every = draft_layout.buckets.all()
    out = []
    for bucket in every[:1] if scope == "quick" else sorted({every[0], every[-1]}):
        start = time.perf_counter()
        try:
            compiled = compile_draft(program, state, pool, draft_layout, bucket, mesh)
        except Exception as err:  # libtpu's refusal, kept to its first line
            message = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
            out.append(Program(bucket, "draft", "draft", time.perf_counter() - start, error=message))
            continue
        measured = Program(bucket, "draft", "draft", time.perf_counter() - start)
        out.append(_measured(measured, compiled, report.weight_bytes + report.kv_pool_bytes))
    return out


def _encoder_programs(config, graphdef, state, mesh, args, scope: str, resident: int) -> list[Program]:
    """A vision-language model's image encoder calls (runner/image_encoder.py) in the shapes
    start-up compiles (`quick`: the first), each as a program "encoder" whose bucket is the
    call's first argument's (rows, width)."""
    if getattr(args, "vision", None) is None:
        return []
    model_cls = resolve_architecture(config.model_config.hf_config)[1].model_cls
    calls = model_cls.image_call_shapes(args)
    program = image_call_program(graphdef, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    out = []
    for shapes in calls[:1] if scope == "quick" else calls:
        first = shapes[0].shape
        bucket = (int(np.prod(first[:-1])), first[-1])
        start = time.perf_counter()
        try:
            args_ = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated) for x in shapes]
            compiled = program.lower(state, *args_).compile()
        except Exception as err:  # libtpu's refusal, kept to its first line
            message = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
            out.append(Program(bucket, "encoder", "encoder", time.perf_counter() - start, error=message))
            continue
        out.append(
            _measured(Program(bucket, "encoder", "encoder", time.perf_counter() - start), compiled, resident)
        )
    return out


def _larger_slice(report: Report, utilization: float) -> str:
    """Which tensor parallel size would leave room for a KV pool (about: weights shrink with tp
    but for the few that every device holds whole)."""
    weights = report.weight_bytes * report.tensor_parallel_size
    budget = utilization * Target.parse(report.target).chip.hbm_bytes
    gib = weights / 2**30
    for tp in (2, 4, 8, 16, 32, 64):
        if tp > report.tensor_parallel_size and weights / tp < 0.8 * budget:
            return f" ({gib:.1f} GiB of weights; about tp={tp} would leave room for one)"
    return f" ({gib:.1f} GiB of weights)"


def _compile(steps: StepPrograms, bucket, variant: StepVariant, resident: int) -> list[Program]:
    name = variant_name(variant)
    parts = ("forward", "sample") if variant.with_token_bitmask else ("step",)
    start = time.perf_counter()
    try:
        compiled = steps.compile(bucket, variant)
    except Exception as err:  # libtpu's refusal, kept to its first line
        message = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
        return [Program(bucket, name, part, time.perf_counter() - start, error=message) for part in parts]
    seconds = time.perf_counter() - start
    compiled = compiled if isinstance(compiled, tuple) else (compiled,)
    return [
        _measured(
            Program(bucket, name, part, seconds / len(parts)), program, resident if part == "sample" else 0
        )
        for part, program in zip(parts, compiled)
    ]


def _measured(program: Program, compiled: jax.stages.Compiled, resident: int) -> Program:
    memory = compiled.memory_analysis()
    program.argument_bytes = memory.argument_size_in_bytes
    program.output_bytes = memory.output_size_in_bytes
    program.alias_bytes = memory.alias_size_in_bytes
    program.temp_bytes = memory.temp_size_in_bytes
    program.code_bytes = memory.generated_code_size_in_bytes
    program.resident_bytes = resident
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    program.flops = float(cost.get("flops", 0.0))
    program.bytes_accessed = float(cost.get("bytes accessed", 0.0))
    program.kernels = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    return program
