"""The device side: owns the parameters, the KV pool, the processor slots and the compiled steps.

The model is split once into (graphdef, state); one pure step function (forward over a
ragged batch, logits at sampled rows, sampling) is compiled ahead of time for every
shape bucket, with the KV pool donated so it is updated in place. `dispatch` turns a
SchedulerOutput into one host->device transfer and one compiled call, and returns without waiting
for the device; `collect` makes the one device->host copy of its results. (`execute`: both.)

The step program itself is runner/step.py, and its variants (StepVariant) are compiled the
first time a batch needs them. Compiled steps are kept in a StepCache (runner/step_cache.py):
the runner's own unless one is handed in to share with other runners.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import operator
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import EngineConfig
from jaxserve.layers.linear import tile_q4_stacks
from jaxserve.loader.model_loader import build_model_args, load_model
from jaxserve.lora.adapter import LoRAAdapter
from jaxserve.runner import batch as batch_lib
from jaxserve.runner import executable_cache, kv_calibration
from jaxserve.runner import sleep as sleep_mode
from jaxserve.runner.bucket_compiles import BucketCompiles
from jaxserve.runner.image_encoder import ImageEncoder
from jaxserve.runner.kv_cache import allocate_kv_pool
from jaxserve.runner.lora_writer import LoRAWriter
from jaxserve.runner.offload import offload_layers
from jaxserve.runner.processor_slots import ProcessorSlots
from jaxserve.runner.step import StepResult, StepVariant
from jaxserve.runner.step_cache import StepCache
from jaxserve.runner.step_programs import StepLayout, StepPrograms, abstract
from jaxserve.runner.swap import SwapBuffers
from jaxserve.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.sharding import mesh_for
from pallas_kernels import native

logger = logging.getLogger(__name__)


_IMAGES = operator.attrgetter("images")


def bytes_per_device(tree) -> dict:
    """Bytes of the arrays in `tree` held on each (addressable) device."""
    held = collections.Counter()
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return held


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        mesh: jax.sharding.Mesh | None = None,
        step_cache: StepCache | None = None,
    ):
        """step_cache: compiled steps to share with the other runners given the same one (a
        second engine on the same model and shapes then compiles nothing); None: a new one of
        this runner's own."""
        self.config = config
        pooler = config.model_config.pooler_config
        self.pooling = pooler is not None  # every step is of the pool kind
        self._pool = StepVariant.for_pooling(pooler.pooling_type) if self.pooling else None
        self.step_cache = step_cache if step_cache is not None else StepCache()
        self.mesh = mesh or mesh_for(config.parallel_config)
        # The native CPU kernels (pallas_kernels/native.py), registered before any step is traced
        # or loaded from the executable store; a step traced without them runs the references.
        self.native_kernels = self.mesh.devices.flat[0].platform == "cpu" and native.load()
        self.executables = executable_cache.enable_compilation_cache(
            config.compilation_config.cache_dir, self.mesh
        )
        entry, self.args = build_model_args(config.model_config, config.parallel_config, config.lora_config)
        self._model_cls = entry.model_cls
        self._model_name = f"{entry.model_cls.__module__}.{entry.model_cls.__qualname__}"
        self._load_weights(entry)
        self._plan_layout()
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self.processor_slots = ProcessorSlots(self.num_slots, self.args.vocab_size, self._replicated)
        # The last dispatched step's sampled tokens, padded to the largest sequence bucket: what a
        # step fed a token the host does not have yet reads it from.
        self._last_tokens = jax.device_put(np.zeros(self.buckets.seqs[-1], np.int32), self._replicated)
        self._bitmasks: dict[int, np.ndarray] = {}  # host mask buffers by sequence bucket
        # The step programs, compiled on first use (of a bucket and variant) from shapes alone
        self.steps = StepPrograms(
            self.graphdef,
            abstract(self.state),
            self.mesh,
            self.layout,
            vocab_size=self.args.vocab_size,
            step_cache=self.step_cache,
            executables=self.executables,
            stored_as=(self._model_name, repr(self.args), ("native kernels", self.native_kernels)),
        )
        self.compiles = BucketCompiles(self.buckets, self._compile_plain)
        # Several processes (jax.distributed): process 0 publishes every call the others must
        # replay (jaxserve/distributed.py); they run the same programs on their own devices.
        self.channel = None
        self._off_device: sleep_mode.OffDevice | None = None  # the weights, while asleep
        if jax.process_count() > 1 and jax.process_index() == 0:
            from jaxserve.distributed import StepChannel

            self.channel = StepChannel()
        # The pool's zero-fill (first touch of fresh memory: about a second per GiB on a small VM)
        # runs in XLA, outside the GIL, while this thread traces or loads the first steps.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-kv-pool") as pool:
            allocating = pool.submit(allocate_kv_pool, self.kv_spec, self.num_blocks, self.mesh)
            if not config.compilation_config.enforce_eager:
                self.precompile()
            self.kv_pool = allocating.result()

    def _load_weights(self, entry) -> None:
        """The weights on the mesh (graphdef, state), the LoRA slots' writer and their adapters; a
        vision-language model's image encoder and its cache (runner/image_encoder.py)."""
        start = time.perf_counter()
        self.graphdef, self.state = self._load()
        mm_cache = self.config.model_config.mm_cache_bytes
        vision = getattr(self.args, "vision", None) is not None
        self.images = ImageEncoder(self.graphdef, self.mesh, mm_cache) if vision else None
        self.state, offloaded = offload_layers(self.state, self.config.cache_config.cpu_offload_gb)
        self.lora = LoRAWriter(self.state, self.args, self.mesh)
        lora = self.config.lora_config
        self.adapter_spec = (
            None
            if lora is None
            else self.lora.adapter_spec(self.state, entry.model_cls, entry.split_tensors, lora)
        )
        logger.info(
            "Loaded weights in %.2f s: %.1f MiB in all, %.1f MiB on the fullest of %d devices (%.1f MiB "
            "of it in host memory: --cpu-offload-gb)",
            time.perf_counter() - start, sum(x.nbytes for x in jax.tree.leaves(self.state)) / 2**20,
            max(bytes_per_device(self.state).values()) / 2**20, self.mesh.size, offloaded / 2**20,
        )  # fmt: skip

    def _plan_layout(self) -> None:
        """The step layout (runner/step_programs.py StepLayout) and the names this runner
        reads it by: KV pool, pages, buckets, slots."""
        max_model_len = self.config.scheduler_config.max_model_len
        self.layout = StepLayout.plan(self.config, self.args, self.mesh, bool(self.lora.keys))
        self.attention_backend = self.layout.attention_backend
        self.kv_spec, self.num_blocks = self.layout.kv_spec, self.layout.num_blocks
        self.page_size, self.pages_per_seq = self.kv_spec.page_size, self.layout.pages_per_seq
        self.pad_slot = self.layout.pad_slot
        self.buckets, self.num_slots = self.layout.buckets, self.layout.num_slots
        self.num_top_logprobs = self.layout.num_top_logprobs
        # A quantized pool's per-layer key and value scales (runner/kv_scales.py), sent with each step.
        self.kv_scales = self.layout.kv_scales
        # swap preemption: preempted requests' pages in host memory (runner/swap.py), else None
        self.swapped = SwapBuffers.of(self.config.scheduler_config.preemption_mode, self.layout)
        kv_tokens = (self.num_blocks - 1) * self.page_size  # block 0 is never handed out
        logger.info(
            "KV cache size: %s tokens; maximum concurrency for %s tokens per request: %.2fx",
            f"{kv_tokens:,}", f"{max_model_len:,}", kv_tokens / max_model_len,
        )  # fmt: skip

    def prepare(
        self, sched: SchedulerOutput, bucket: tuple[int, int], verify: bool = False
    ) -> batch_lib.BatchInputs:
        """The step's host arrays in this runner's layout, with the pool's current KV scales."""
        return self.layout.prepare(sched, bucket, self.kv_scales, verify)

    def step_args(self, inputs: batch_lib.BatchInputs) -> tuple:
        """What the plain step program (steps.programs["step", StepVariant()]) is called with on
        `inputs`: weights, KV pool, no processor state, the last sampled tokens, the inputs on
        the devices. For a test or a tool that calls, traces or exports the step itself."""
        return self.state, self.kv_pool, None, self._last_tokens, jax.device_put(inputs, self._replicated)

    def _compile(self, bucket: tuple[int, int], variant: StepVariant = StepVariant()):
        return self.steps.compile(bucket, variant)

    def _compile_plain(self, bucket: tuple[int, int]) -> None:
        """What start-up compiles for a bucket: the programs a request asking for no extra runs,
        the verify kind's too with speculative decoding (a pooling model: the pool kind alone)."""
        if self.pooling:
            self._compile(bucket, self._pool)
            return
        self._compile(bucket)
        if self.images is not None:  # any chunk of a prompt may hold image rows
            self._compile(bucket, StepVariant(with_prompt_embeds=True))
        if self.layout.num_speculative_tokens:
            self._compile(bucket, StepVariant(kind="verify"))

    def precompile(self) -> None:
        """Compile the buckets a first request needs now and the rest in the background
        (runner/bucket_compiles.py)."""
        if self.lora.keys:  # the program that writes adapters into slots (slot 0 is empty still)
            self.set_lora_slot(0, None)
        if self.images is not None:
            self.images.compile(self.state, self._model_cls.image_call_shapes(self.args))
        self.compiles.start()

    def stop_compiling(self) -> None:
        """Let the background compile finish the bucket it is on and stop (server shutdown)."""
        self.compiles.stop()

    def wait_compiled(self) -> None:
        """Block until every bucket is compiled (the offline LLM wants them all before it runs)."""
        self.compiles.wait()

    @property
    def ready_buckets(self):
        """The buckets a step may use without compiling (all of them under enforce_eager)."""
        return self.compiles.ready

    @property
    def ready_token_budget(self) -> int:
        """The largest step, in tokens, that runs without compiling."""
        return self.ready_buckets.tokens[-1]

    @property
    def kv_pool_lost(self) -> bool:
        """True after a failed call consumed the donated pool without returning a new one."""
        return self.kv_pool.is_deleted()

    def reset_kv_pool(self) -> None:
        """Rebuild the device state a failed step may have consumed: the KV pool, and the
        processor slots (the scheduler refills those as requests resume)."""
        if self.channel is not None:
            self.channel.publish("reset_kv_pool")
        self._new_kv_pool()

    def _new_kv_pool(self) -> None:
        self.kv_pool = allocate_kv_pool(self.kv_spec, self.num_blocks, self.mesh)
        self.processor_slots.state = None

    # ---- sleep mode (runner/sleep.py) --------------------------------------------------------

    @property
    def released(self) -> tuple[str, ...]:
        """What sleep() let go of that wake_up() has not taken back: "weights", "kv_cache"."""
        gone = {"weights": self._off_device is not None, "kv_cache": self.kv_pool.is_deleted()}
        return tuple(tag for tag in sleep_mode.TAGS if gone[tag])

    @property
    def weights_on_host(self) -> int:
        """Weight arrays kept in host memory while asleep (level 1: all; level 2: LoRA's only)."""
        return 0 if self._off_device is None else len(self._off_device.saved)

    def sleep(self, level: int) -> int:
        """Free the weights (level 1: kept in host memory) and the KV pool on the devices; the
        bytes freed on this process's devices."""
        if self.channel is not None:
            self.channel.publish("sleep", level)
        freed = 0
        if self._off_device is None:
            freed += sum(bytes_per_device(self.state).values())
            self._off_device = sleep_mode.OffDevice(self.state, level, self.lora.keys)
        else:
            self._off_device.deepen(level)
        if not self.kv_pool.is_deleted():
            freed += sum(bytes_per_device(self.kv_pool).values())
            self.kv_pool.delete()
        return freed

    def wake_up(self, tags: Sequence[str] = sleep_mode.TAGS) -> None:
        """Take back what sleep() freed, of `tags`: the weights as they were, an empty KV pool."""
        if self.channel is not None:
            self.channel.publish("wake_up", tuple(tags))
        if "weights" in tags and self._off_device is not None:
            self.state = self._off_device.restore(self.state, lambda: self._load()[1])
            self._off_device = None
        if "kv_cache" in tags and self.kv_pool.is_deleted():
            self._new_kv_pool()

    def calibrate_kv_scales(self, token_ids: Sequence[int]) -> None:
        """Set a quantized pool's scales from the keys and values the model writes over
        `token_ids` (runner/kv_calibration.py)."""
        if self.channel is not None:
            self.channel.publish("calibrate_kv_scales", token_ids)
        ids = tuple(token_ids[: self.config.scheduler_config.max_model_len])
        self.kv_scales = kv_calibration.measure(self, ids)

    def _load(self) -> tuple[nnx.GraphDef, nnx.State]:
        """The model's weights on the mesh; 4-bit stacks in the native kernel's tiles where it runs."""
        c = self.config
        graphdef, state = load_model(c.model_config, self.mesh, c.parallel_config, c.lora_config)
        if self.native_kernels and self.mesh.size == 1:
            state = tile_q4_stacks(state)
        return graphdef, state

    def set_lora_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Write an adapter (None: zeros, the base model) into LoRA slot `slot` of every adapted
        projection: one compiled program for any slot and adapter (ranks are padded to the
        slots' rank with zeros), so loading and swapping adapters never compiles."""
        if self.channel is not None:
            self.channel.publish("set_lora_slot", slot, adapter)
        self.lora.write(self.state, slot, adapter)

    @property
    def num_compiled(self) -> int:
        return len(self.steps.compiled)

    def execute(self, sched: SchedulerOutput, fill_bitmask=None) -> ModelRunnerOutput:
        """Run one step and wait for its results."""
        return self.collect(self.dispatch(sched, fill_bitmask))

    def dispatch(
        self,
        sched: SchedulerOutput,
        fill_bitmask: Callable[[np.ndarray], None] | None = None,
        bitmask: np.ndarray | None = None,
    ) -> DispatchedStep:
        """Start one step on the device and return without waiting for it (collect() waits). With
        constrained rows (structured outputs), `fill_bitmask` writes their token masks into the
        all-allowed [seq bucket, ceil(vocab / 32)] int32 array it is given; it is called while the
        device runs the forward pass. `bitmask`: the mask already filled (how process 0 hands it
        to the others, which replay the call)."""
        bucket = self.ready_buckets.pick(sched.num_tokens, len(sched.seqs))
        published = sched  # (the others encode a step's images themselves, as this process does)
        if self.images is not None and any(map(_IMAGES, sched.seqs)):
            sched = self.images.feed(self.state, sched)
        variant = self._pool if self.pooling else StepVariant.for_batch(sched)
        if variant.with_token_bitmask and bitmask is None:
            bitmask = self._bitmask(bucket[1])
            if self.channel is not None:  # the others need the mask with the call: no overlap here
                fill_bitmask(bitmask)
                fill_bitmask = None
        if self.channel is not None:
            self.channel.publish("dispatch", published, None, bitmask)
        if sched.swap:  # before the step, which may write into pages a swapped request gave back
            self.kv_pool = self.swapped.apply(self.kv_pool, sched.swap)
        inputs = self.prepare(sched, bucket, variant.kind == "verify")
        for s in sched.seqs:
            if s.processor_init is not None:
                self.processor_slots.fill(s.processor_init)
        compiled = self._compile(bucket, variant)
        processors = self.processor_slots.state if variant.with_processor_state else None
        packed = batch_lib.PackedBatch.pack(inputs)
        # The compiled call transfers a host argument itself, in C++: ~0.3 ms a step less than
        # device_put's Python path. Put it first when two programs read it (or several processes
        # build one global array from it).
        if variant.with_token_bitmask or self.mesh.is_multi_process:
            packed = jax.device_put(packed, self._replicated)
        last = self._last_tokens
        if variant.with_token_bitmask:
            forward_program, sample_program = compiled
            self.kv_pool, logits, prompt = forward_program(self.state, self.kv_pool, last, packed)
            if fill_bitmask is not None:
                fill_bitmask(bitmask)  # the host's work while the device runs the forward pass
            processors, self._last_tokens, result = sample_program(
                logits, processors, packed, jax.device_put(bitmask, self._replicated), last
            )
            result = dataclasses.replace(result, prompt=prompt)
        else:
            self.kv_pool, processors, self._last_tokens, result = compiled(
                self.state, self.kv_pool, processors, last, packed
            )
        if variant.with_processor_state:
            self.processor_slots.state = processors
        return DispatchedStep(sched, inputs, result)

    @staticmethod
    def is_ready(step: DispatchedStep) -> bool:
        """Whether the step has finished on the device (collect() would not wait)."""
        return step.result.tokens.is_ready()

    @staticmethod
    def wait_ready(step: DispatchedStep) -> None:
        """Block until the step has finished on the device, without reading its results (the
        interpreter is free meanwhile): how the server's loop learns that a step ended."""
        step.result.tokens.block_until_ready()

    def collect(self, step: DispatchedStep) -> ModelRunnerOutput:
        """Wait for a dispatched step: the one device->host copy of its results (several processes:
        from this process's own replica)."""
        if self.mesh.is_multi_process:
            result = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), step.result)
        else:
            result = jax.device_get(step.result)
        return self._runner_output(step.sched, step.inputs, result)

    def _bitmask(self, num_seqs: int) -> np.ndarray:
        """The host's mask buffer of a sequence bucket, reset to all-allowed."""
        buf = self._bitmasks.get(num_seqs)
        if buf is None:
            buf = self._bitmasks[num_seqs] = np.empty((num_seqs, self.steps.mask_words), np.int32)
        buf.fill(-1)
        return buf

    @staticmethod
    def _runner_output(
        sched: SchedulerOutput, inputs: batch_lib.BatchInputs, result: StepResult
    ) -> ModelRunnerOutput:
        """The host copy's rows that mean something: the sampled rows of the scheduled sequences
        (not the padding), and each prompt's rows of prompt logprobs."""
        if result.pooled is not None:  # a pooling model's step: every row's sums, nothing sampled
            tokens = None if result.token_rows is None else result.token_rows[: sched.num_tokens]
            return ModelRunnerOutput.of_pooling(result.pooled[: len(sched.seqs)], tokens)
        rows = [i for i, s in enumerate(sched.seqs) if s.sampling is not None]
        num_sampled = None
        if result.num_sampled is not None:  # the verify layout: each sequence's kept rows
            num_sampled = result.num_sampled[rows]
            starts = inputs.cu_num_logits[rows]
            ends = np.cumsum(num_sampled)
            rows = np.repeat(starts - (ends - num_sampled), num_sampled) + np.arange(
                ends[-1] if len(ends) else 0
            )
        elif len(rows) == len(sched.seqs):
            rows = slice(0, len(rows))  # every row samples (decodes): views, not copies
        prompt = {}
        if result.prompt is not None:
            cu = inputs.meta.cu_q_lens
            for i, s in enumerate(sched.seqs):
                if s.prompt_logprob_targets:
                    prompt[s.request_id] = result.prompt.take(
                        slice(cu[i], cu[i] + len(s.prompt_logprob_targets))
                    )
        return ModelRunnerOutput(
            req_ids=tuple(s.request_id for s in sched.seqs if s.sampling is not None),
            sampled_token_ids=result.tokens[rows],
            logprobs=result.logprobs[rows],
            top_logprobs=None if result.top is None else result.top.take(rows),
            prompt_logprobs=prompt,
            num_sampled=num_sampled,
        )


class DispatchedStep(NamedTuple):
    """A step running on the device: what collect() needs to read its results."""

    sched: SchedulerOutput
    inputs: batch_lib.BatchInputs  # the host's copy of its inputs
    result: StepResult  # device arrays, ready when the step is done
