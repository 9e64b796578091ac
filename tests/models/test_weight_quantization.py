"""Weight-only quantization (--quantization int8 / fp8) against transformers.

The reference is transformers on the same tiny random checkpoint with each decoder projection
quantized and dequantized in torch, by the textbook rule (symmetric, one scale per output
channel: its largest magnitude maps to 127, or to fp8 e4m3's 448): jaxserve's quantized
logits must equal that model's within float tolerance at every prompt position, across the
families' projection layouts (GQA, biases, OPT's fc1/fc2, GPT-2's fused Conv1D, MoE experts).
Against the unquantized model the logits move by a bounded amount and greedy choices hold.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference_checks import (
    assert_greedy_generation_matches,
    assert_logits_match_at_every_position,
    prompt_logits,
    quantized_reference,
    teacher_forced_logits,
)
from tiny_models import engine_kwargs, make_checkpoint, make_llama_checkpoint

from jaxserve import LLM
from jaxserve.args import EngineArgs
from jaxserve.runner.model_runner import ModelRunner

FAMILIES = {  # name: (config class, model class, overrides)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 128}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 256}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    config_cls, model_cls, overrides = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(f"quant-{request.param}")
    return str(path), make_checkpoint(path, config_cls, model_cls, overrides, "float32", 0)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_logits_equal_transformers_with_the_same_quantized_weights(family, quantization):
    path, model = family
    assert_logits_match_at_every_position(
        path, quantized_reference(model, quantization), quantization=quantization, lengths=(1, 9, 45)
    )


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant-llama-gqa")
    return str(path), make_llama_checkpoint(path, "gqa")


@pytest.mark.parametrize("quantization, atol", [("int8", 0.15), ("fp8", 0.6)])
def test_quantized_logits_stay_near_the_float_models(llama, quantization, atol):
    """The quantization error itself, on logits of spread ~2.7: int8 moves them by < 0.15 (fp8,
    with 3 mantissa bits, < 0.6), and most argmaxes stay."""
    path, model = llama
    runner = ModelRunner(
        EngineArgs(model=path, quantization=quantization, **engine_kwargs()).create_engine_config()
    )
    ids = list(range(5, 69))
    got, want = prompt_logits(runner, ids), teacher_forced_logits(model, ids)
    assert np.abs(got - want).max() < atol
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= (0.9 if quantization == "int8" else 0.75)
    flat = dict(runner.state.flat_state())
    assert (
        str(flat[("layers", "q_proj")].value.dtype) == {"int8": "int8", "fp8": "float8_e4m3fn"}[quantization]
    )
    assert flat[("layers", "q_proj_scale")].value.shape == (2, 64)  # a scale per output channel
    assert str(flat[("embed_tokens",)].value.dtype) == "float32"  # embeddings stay unquantized


def test_greedy_generation_equals_transformers_with_the_same_quantized_weights(llama):
    path, model = llama
    llm = LLM(path, quantization="int8", **engine_kwargs())
    prompts = [[5, 6, 7], list(range(20, 61)), [9] * 17]
    assert_greedy_generation_matches(llm, quantized_reference(model, "int8"), prompts, max_tokens=16)
