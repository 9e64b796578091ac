"""A quantized KV cache (--kv-cache-dtype int8 / fp8 / fp8_e5m2) against transformers.

The reference is transformers on the same tiny random checkpoint whose attention reads each
layer's keys (after rope) and values quantized and dequantized in torch with that layer's
scales, by the textbook rule (x / scale rounded to int8 or cast to fp8, saturating): jaxserve's
logits must equal that model's at every prompt position, and its greedy decodes (which read
pages written over many steps) its argmaxes. The scales are checked against where they come
from: the largest |k| and |v| transformers computes over the calibration text, or the file.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from reference_checks import (
    assert_greedy_generation_matches,
    kv_amax,
    kv_quantized_reference,
    prompt_logits,
    teacher_forced_logits,
)
from tiny_models import engine_kwargs, make_llama_checkpoint

from jaxserve import LLM
from jaxserve.args import EngineArgs
from jaxserve.runner import kv_scales
from jaxserve.runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv-quant-llama-gqa")
    return str(path), make_llama_checkpoint(path, "gqa")


def _scales_file(path, per_rank: list[list[float]], dtype: str = "int8") -> str:
    data = {
        "model_type": "llama",
        "kv_cache": {
            "dtype": dtype,
            "scaling_factor": {
                str(r): {str(i): s for i, s in enumerate(layers)} for r, layers in enumerate(per_rank)
            },
        },
    }
    path.write_text(json.dumps(data))
    return str(path)


# (--kv-cache-dtype, how the scales are chosen)
CASES = {
    "int8-measured": ("int8", {}),  # int8 with no file: measured at start-up
    "fp8-default": ("fp8", {}),  # 1.0
    "fp8-measured": ("fp8", {"calculate_kv_scales": True}),
    "fp8_e5m2-measured": ("fp8_e5m2", {"calculate_kv_scales": True}),
    "int8-file": ("int8", {"quantization_param_path": "FILE"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_transformers_reading_the_same_quantized_kv(llama, case, tmp_path):
    path, model = llama
    kv_dtype, options = CASES[case]
    if "quantization_param_path" in options:
        options = {"quantization_param_path": _scales_file(tmp_path / "s.json", [[0.004, 0.003]])}
    llm = LLM(path, kv_cache_dtype=kv_dtype, **options, **engine_kwargs())
    runner = llm.llm_engine.runner
    pool_dtype = str(runner.kv_pool.dtype)
    assert pool_dtype == {"int8": "int8", "fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[kv_dtype]
    reference = kv_quantized_reference(model, runner.kv_scales, pool_dtype)
    rng = np.random.default_rng(0)
    for n in (1, 9, 45):
        ids = rng.integers(3, 500, size=n).tolist()
        got, want = prompt_logits(runner, ids), teacher_forced_logits(reference, ids)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"{n} tokens")
    # The quantization is really there: against the float model the logits move.
    ids = rng.integers(3, 500, size=45).tolist()
    assert np.abs(prompt_logits(runner, ids) - teacher_forced_logits(model, ids)).max() > 1e-3


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_greedy_decodes_equal_transformers_reading_the_same_quantized_kv(llama, kv_dtype):
    path, model = llama
    llm = LLM(path, kv_cache_dtype=kv_dtype, calculate_kv_scales=True, **engine_kwargs())
    runner = llm.llm_engine.runner
    reference = kv_quantized_reference(model, runner.kv_scales, str(runner.kv_pool.dtype))
    prompts = [[5, 6, 7], list(range(20, 61)), [9] * 17]
    assert_greedy_generation_matches(llm, reference, prompts, max_tokens=24)


def test_measured_scales_follow_the_largest_keys_and_values_over_the_calibration_text(llama):
    path, model = llama
    llm = LLM(path, kv_cache_dtype="int8", **engine_kwargs())
    ids = llm.get_tokenizer().encode(kv_scales.CALIBRATION_TEXT)
    max_len = llm.llm_engine.config.scheduler_config.max_model_len
    assert len(ids) > max_len  # the text is cut at max_model_len (here the tiny model's 256)
    want = kv_amax(model, ids[:max_len]) * kv_scales.HEADROOM["int8"] / 127
    np.testing.assert_allclose(llm.llm_engine.runner.kv_scales, want, rtol=1e-4)
    assert np.all(want[:, 0] != want[:, 1])  # keys and values: each their own


def test_scales_from_a_file_take_the_largest_over_its_ranks(llama, tmp_path):
    path, _ = llama
    file = _scales_file(tmp_path / "s.json", [[0.5, 0.25], [0.125, 2.0]], "float8_e4m3fn")
    args = EngineArgs(model=path, kv_cache_dtype="fp8", quantization_param_path=file, **engine_kwargs())
    runner = ModelRunner(args.create_engine_config())
    np.testing.assert_array_equal(runner.kv_scales, [[0.5, 0.5], [2.0, 2.0]])


@pytest.mark.parametrize(
    "content, error",
    [
        ("not json", "not a KV-scales file"),
        (
            {"kv_cache": {"dtype": "int8", "scaling_factor": {"0": {"0": 0.1}}}},
            r"no scale for layer\(s\) \[1\]",
        ),
        (
            {"kv_cache": {"dtype": "int8", "scaling_factor": {"0": {"0": 0.1, "1": -1}}}},
            "not a positive number",
        ),
        (
            {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 1, "1": 1}}}},
            "for float8_e4m3fn pages",
        ),
        (
            {"model_type": "qwen2", "kv_cache": {"scaling_factor": {"0": {"0": 1, "1": 1}}}},
            "for a qwen2 model",
        ),
        ({"kv_cache": {"scaling_factor": {}}}, "names no tensor-parallel rank"),
    ],
)
def test_a_bad_scales_file_is_refused_in_one_line(llama, tmp_path, content, error):
    path, _ = llama
    file = tmp_path / "s.json"
    file.write_text(content if isinstance(content, str) else json.dumps(content))
    args = EngineArgs(model=path, kv_cache_dtype="int8", quantization_param_path=str(file), **engine_kwargs())
    with pytest.raises(ValueError, match=error) as err:
        ModelRunner(args.create_engine_config())
    assert "\n" not in str(err.value)


def test_int8_pages_double_the_logged_token_capacity_of_bfloat16(llama, caplog):
    path, _ = llama
    capacity = {}
    for kv_dtype in ("auto", "int8"):
        kwargs = engine_kwargs(num_gpu_blocks_override=None, kv_cache_memory_bytes="64K")
        args = EngineArgs(model=path, dtype="bfloat16", kv_cache_dtype=kv_dtype, **kwargs)
        with caplog.at_level(logging.INFO, logger="jaxserve.runner"):
            caplog.clear()
            runner = ModelRunner(args.create_engine_config())
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache size"))
        capacity[kv_dtype] = int(line.split()[3].replace(",", ""))
        pages = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache: "))
        assert f"in {'bfloat16' if kv_dtype == 'auto' else 'int8'} pages" in pages
        assert runner.kv_pool.dtype.itemsize == (2 if kv_dtype == "auto" else 1)
    # 64 KiB of pages of 8 tokens: one page is held back as padding in both.
    assert capacity["int8"] + 8 == 2 * (capacity["auto"] + 8)


def test_without_a_tokenizer_the_scales_are_measured_over_fixed_token_ids(llama):
    path, model = llama
    llm = LLM(path, kv_cache_dtype="int8", skip_tokenizer_init=True, **engine_kwargs())
    ids = kv_scales.calibration_ids(None, 512)
    assert ids == kv_scales.calibration_ids(None, 512)  # the same on every start
    want = kv_amax(model, ids[: llm.llm_engine.config.scheduler_config.max_model_len]) * 1.25 / 127
    np.testing.assert_allclose(llm.llm_engine.runner.kv_scales, want, rtol=1e-4)
