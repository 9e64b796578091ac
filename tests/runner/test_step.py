"""The step program (runner/step.py): which variant a batch needs, and the attention backend as
an explicit, static part of the step's inputs, so one jitted step traced for two backends runs
each backend's own kernel instead of silently reusing the first trace."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tiny_models import engine_kwargs

from jaxserve.args import EngineArgs
from jaxserve.layers.sampler import top_logprobs
from jaxserve.runner import batch as batch_lib
from jaxserve.runner import step as step_lib
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step import StepVariant
from jaxserve.scheduler_output import SamplingRow, ScheduledSeq, SchedulerOutput

GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, output_start=0)


def test_every_variant_once_the_plain_one_first():
    variants = StepVariant.all()
    assert len(variants) == len(set(variants)) == 66  # two sampling kinds, five options; two pool kinds
    assert variants[0] == StepVariant()
    assert {v.kind for v in variants} == {"generate", "verify", "pool", "pool_all"}
    pooling = [v for v in variants if v.kind.startswith("pool")]
    assert pooling == [StepVariant(kind="pool"), StepVariant(kind="pool_all")]  # they take no options
    assert (
        StepVariant(with_processor_state=True, with_top_logprobs=True, with_prompt_logprobs=True) in variants
    )


def test_a_batch_needs_what_some_row_asks_for():
    def seq(row, targets=None):
        return ScheduledSeq("r", (5, 6), 0, (1,), row, prompt_logprob_targets=targets)

    plain = SchedulerOutput((seq(GREEDY), seq(None)))
    assert StepVariant.for_batch(plain) == StepVariant()
    mixed = SchedulerOutput(
        (seq(GREEDY), seq(SamplingRow(0.5, 0, 1.0, 0.0, 1, 0, processor_slot=3)), seq(None, targets=(6,)))
    )
    assert StepVariant.for_batch(mixed) == StepVariant(with_processor_state=True, with_prompt_logprobs=True)
    logprobs = SchedulerOutput((seq(SamplingRow(0.0, 0, 1.0, 0.0, 0, 0, logprobs=0)),))
    assert StepVariant.for_batch(logprobs) == StepVariant(with_top_logprobs=True)
    masked = SchedulerOutput((seq(GREEDY), seq(SamplingRow(0.0, 0, 1.0, 0.0, 0, 0, constrained=True))))
    assert StepVariant.for_batch(masked) == StepVariant(with_token_bitmask=True)
    proposed = SchedulerOutput((seq(GREEDY), ScheduledSeq("p", (5, 6, 7), 9, (1, 2), GREEDY, num_drafts=2)))
    assert StepVariant.for_batch(proposed) == StepVariant(kind="verify")


def test_one_jitted_step_traced_for_two_backends_runs_each_ones_kernel(tiny_llama_gqa):
    """The runner's own jitted step, traced for the reference and then for the interpreted GPU
    kernel: the second trace holds the Pallas kernel and the first none, and both compute the
    same tokens and logprobs. A backend read from ambient state while tracing would give the
    second call the first trace."""
    # a small pool: interpreting the kernel costs in the size of the pool
    kw = engine_kwargs(attention_backend="pallas-gpu-interpret", num_gpu_blocks_override=8, max_model_len=32)
    runner = ModelRunner(EngineArgs(model=tiny_llama_gqa[0], **kw).create_engine_config())
    assert runner.attention_backend == "gpu-interpret"
    sched = SchedulerOutput(
        (
            ScheduledSeq("a", tuple(range(3, 12)), 0, (1, 2), GREEDY),
            ScheduledSeq("b", (40, 41, 42), 0, (3,), GREEDY),
        )
    )
    step = runner.steps.programs["step", StepVariant()]

    def inputs(backend: str) -> batch_lib.BatchInputs:
        prepared = batch_lib.prepare(
            sched, 16, 2, runner.page_size, runner.pages_per_seq, runner.pad_slot, backend
        )
        assert prepared.meta.backend == backend
        return prepared

    results = {}
    for backend in ("reference", "gpu-interpret"):
        args = runner.step_args(inputs(backend))
        kernel_calls = str(step.trace(*args).jaxpr).count("pallas_call")  # GPU: a decode and a prefill launch
        assert (kernel_calls > 0) == (backend != "reference"), (backend, kernel_calls)
        runner.kv_pool, _, _, result = step(*args)  # the pool is donated: the next call reads the new one
        results[backend] = jax.device_get(result)
    ref, kernel = results["reference"], results["gpu-interpret"]
    np.testing.assert_array_equal(kernel.tokens[:2], ref.tokens[:2])
    np.testing.assert_allclose(kernel.logprobs[:2], ref.logprobs[:2], atol=1e-5)


def test_prompt_logprobs_in_chunks_equal_the_whole(monkeypatch):
    """Rows ranked PROMPT_CHUNK at a time, the last chunk padded, give what the whole
    [rows, vocab] log-softmax gives: same top-k, same target logprobs and ranks."""
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((37, 8)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((8, 50)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 50, 37), jnp.int32)
    whole = top_logprobs(jax.nn.log_softmax(hidden @ head, axis=-1), targets, 5)
    monkeypatch.setattr(step_lib, "PROMPT_CHUNK", 16)  # 3 chunks, the last 5 rows of padding
    chunked = step_lib.prompt_logprobs(lambda h: h @ head, hidden, targets, 5)
    for got, want in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
