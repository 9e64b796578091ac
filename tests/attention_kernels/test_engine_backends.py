"""The engine with a Pallas kernel in place of the reference attention: interpreted (as on
CPU it must be), the same greedy tokens on a tiny Llama over a batch that mixes prefill
chunks and decodes; and the whole step lowered for TPU and GPU targets with the kernels."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from test_tpu_kernel import target_tpu
from tiny_models import engine_kwargs, make_family_checkpoint

from jaxserve import LLM, SamplingParams
from jaxserve.args import EngineArgs
from jaxserve.runner.step import StepVariant
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.scheduler_output import SchedulerOutput

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,speculative", [("pallas-gpu-interpret", None), ("pallas-tpu-interpret", NGRAM)]
)
def test_greedy_tokens_equal_the_reference_backends(tiny_llama_gqa, backend, speculative):
    """On the TPU kernel with n-gram proposals as well: verify steps put a sequence's proposed
    tokens through the kernel as extra query rows."""
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, size=n).tolist()} for n in (5, 21, 40, 9)]
    prompts.append({"prompt_token_ids": [9, 10, 11, 12] * 3})  # its continuation repeats: proposals
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # the fourth prompt under a grammar: the masked step (forward, then sampling) runs the kernel too
    guided = plain.clone(structured_outputs=StructuredOutputsParams(regex="[a-z]+( [a-z]+)*"))
    params = [plain, plain, plain, guided, plain]
    # the 40-token prompt is chunked; a small pool, since interpreting a kernel costs in its size
    kw = engine_kwargs(max_num_batched_tokens=32, num_gpu_blocks_override=24)
    want = [
        o.outputs[0].token_ids for o in LLM(tiny_llama_gqa[0], **kw).generate(prompts, params, use_tqdm=False)
    ]
    llm = LLM(tiny_llama_gqa[0], attention_backend=backend, speculative_config=speculative, **kw)
    assert llm.llm_engine.config.compilation_config.attention_backend == backend.removeprefix("pallas-")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    if speculative:
        assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    # The TPU layout pads head_dim (16 here) to whole 128-lane rows; the GPU's keeps it.
    runner = llm.llm_engine.runner
    assert runner.kv_pool.shape[-1] == (128 if "tpu" in backend else runner.args.head_dim)
    assert runner.kv_spec.bytes_per_block * runner.num_blocks == runner.kv_pool.nbytes


def test_int8_kv_pages_give_the_reference_backends_tokens_through_the_tpu_kernel(tiny_llama_gqa):
    """An int8 KV cache served by the TPU kernel (interpreted): the pages of 32 tokens it picks
    for 1-byte pages when no --block-size is given, the same scales and tokens as the reference,
    and again after a sleep (the pool comes back in the kernel's layout, the scales kept)."""
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, size=n).tolist()} for n in (5, 40, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = engine_kwargs(
        max_num_batched_tokens=32,
        num_gpu_blocks_override=8,
        kv_cache_dtype="int8",
        block_size=None,
        enable_sleep_mode=True,
    )
    runs = {}
    for backend in ("reference", "pallas-tpu-interpret"):
        llm = LLM(tiny_llama_gqa[0], attention_backend=backend, **kw)
        runner = llm.llm_engine.runner
        assert runner.page_size == (32 if "tpu" in backend else 16) and str(runner.kv_pool.dtype) == "int8"
        runs[backend] = (
            runner.kv_scales,
            [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)],
        )
    np.testing.assert_allclose(runs["reference"][0], runs["pallas-tpu-interpret"][0], rtol=1e-5)
    assert runs["reference"][1] == runs["pallas-tpu-interpret"][1]
    llm.sleep(1)
    llm.wake_up()
    assert runner.kv_pool.shape[-1] == 128 and str(runner.kv_pool.dtype) == "int8"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == runs[
        "reference"
    ][1]


def test_tpu_refuses_pages_it_cannot_tile(tiny_llama_gqa):
    args = EngineArgs(
        model=tiny_llama_gqa[0], attention_backend="pallas-tpu-interpret", dtype="bfloat16", block_size=8
    )
    with pytest.raises(ValueError, match=r"--block-size 8 .* bfloat16 .* multiple of 16"):
        args.create_engine_config()
    args.dtype = "float32"  # 8 rows of 32 bits fill a sublane tile
    assert args.create_engine_config().cache_config.block_size == 8
    args.kv_cache_dtype = "int8"  # 1-byte pages: 32 rows
    with pytest.raises(ValueError, match=r"--block-size 8 .* int8 KV pages: it must be a multiple of 32"):
        args.create_engine_config()


def test_step_lowers_for_tpu_and_gpu_with_the_kernels(tmp_path, monkeypatch):
    """A Gemma-2 step in bfloat16 (soft cap, a window on every other layer passed through the
    layer scan, the KV pool donated) exported for a TPU and a CUDA target: each kernel's
    constraints hold for the shapes the engine really gives it. Lowering only: no compile."""
    target_tpu(monkeypatch)
    make_family_checkpoint(tmp_path, "gemma2")
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    targets = (("tpu", "tpu", "@tpu_custom_call", 1), ("cuda", "gpu", "@__gpu$xla.gpu.triton", 2))
    for platform, backend, kernel, launches in targets:
        # The engine as it would be built there (the TPU's KV pool padded to 128 lanes), its
        # step traced with the compiled kernel instead of the interpreted one.
        kw = engine_kwargs(block_size=16, dtype="bfloat16", attention_backend=f"pallas-{backend}-interpret")
        runner = LLM(str(tmp_path), **kw).llm_engine.runner
        inputs = runner.layout.prepare(SchedulerOutput(seqs=()), (64, 8))
        inputs = dataclasses.replace(inputs, meta=dataclasses.replace(inputs.meta, backend=backend))
        step = runner.steps.programs[
            "step", StepVariant()
        ]  # the runner's own step, given the compiled kernel's name
        with jax.set_mesh(runner.mesh):
            exported = jax.export.export(step, platforms=[platform], disabled_checks=[triton])(
                *runner.step_args(inputs)
            )
        # One attention call in the step (the layers are a scan over stacked weights): one
        # Mosaic kernel on TPU, the decode and prefill launches on GPU; nothing else custom.
        calls = re.findall(r"stablehlo.custom_call (@[^(]+)\(", exported.mlir_module())
        assert calls == [kernel] * launches, platform
