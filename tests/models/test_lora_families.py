"""LoRA adapters on every family's projection layout, against transformers + peft (the Llama
itself in test_lora.py).

Per family, two random PEFT adapters on every module PEFT would target there: one of rank 8 with
rsLoRA and LoRA biases (lora_bias, --enable-lora-bias), one of rank 4 without. Fused modules are
read through the family's own checkpoint splitting: Phi-3's qkv_proj and gate_up_proj, GPT-2's
Conv1D c_attn (stored [in, out], PEFT's fan_in_fan_out); OPT names its projections out_proj, fc1
and fc2; an MoE model takes adapters on its attention, and refuses one on its experts. With both
adapters in slots, jaxserve's logits at every prompt position equal peft's model with each
adapter, and the base model's with none.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from reference_checks import prompt_logits, teacher_forced_logits
from tiny_models import DENSE_FAMILIES, engine_kwargs, make_checkpoint, make_lora_adapter

from jaxserve.args import EngineArgs
from jaxserve.config import LoRAConfig
from jaxserve.lora.adapter import read_adapter
from jaxserve.runner.model_runner import ModelRunner

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = {  # name: (config class, model class, overrides, the modules PEFT adapts)
    "mistral": (*DENSE_FAMILIES["mistral_swa"], LLAMA_TARGETS),
    "qwen2": (*DENSE_FAMILIES["qwen2"], LLAMA_TARGETS),  # q/k/v biases in the base model
    "qwen3": (*DENSE_FAMILIES["qwen3"], LLAMA_TARGETS),  # q/k norms, head_dim != hidden / heads
    "gemma": (*DENSE_FAMILIES["gemma"], LLAMA_TARGETS),
    "gemma2": (*DENSE_FAMILIES["gemma2"], LLAMA_TARGETS),
    "gemma3": (*DENSE_FAMILIES["gemma3"], LLAMA_TARGETS),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 128}, ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 256},
        ["c_attn", "c_proj", "c_fc"],
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
        ["q_proj", "k_proj", "v_proj", "o_proj"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(runner with both adapters in slots 0 and 1, base model, peft models and adapter
    directories by slot)."""
    config_cls, model_cls, overrides, targets = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = make_checkpoint(path, config_cls, model_cls, overrides, "float32", 0)
    adapters = []
    for seed, (rank, rslora, bias) in enumerate(((8, True, True), (4, False, False))):
        adapter = str(tmp_path_factory.mktemp(f"lora-{request.param}-{rank}"))
        peft_model = make_lora_adapter(
            base, adapter, rank, 2 * rank, targets, 10 + seed, rslora, lora_bias=bias
        )
        adapters.append((adapter, peft_model))
    config = EngineArgs(model=str(path), **engine_kwargs()).create_engine_config()
    lora = LoRAConfig(max_loras=2, max_lora_rank=8, bias=True)
    runner = ModelRunner(dataclasses.replace(config, lora_config=lora))
    for slot, (adapter, _) in enumerate(adapters):
        runner.set_lora_slot(slot, read_adapter(adapter, runner.adapter_spec))
    return runner, base, [m for _, m in adapters], [a for a, _ in adapters]


def test_logits_equal_peft_with_each_adapter(family):
    runner, base, peft_models, _ = family
    rng = np.random.default_rng(0)
    for n in (1, 23):
        ids = rng.integers(3, 500, size=n).tolist()
        want_base = teacher_forced_logits(base, ids)
        np.testing.assert_allclose(prompt_logits(runner, ids), want_base, atol=1e-4, rtol=0)
        for slot, model in enumerate(peft_models):
            want = teacher_forced_logits(model, ids)
            got = prompt_logits(runner, ids, lora_slot=slot)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"slot {slot}, {n} tokens")
            assert np.abs(want - want_base).max() > 1e-2  # the adapter matters


def test_adapters_on_experts_or_with_unasked_biases_are_refused(family, tmp_path):
    import json

    from safetensors.numpy import save_file

    runner, _, _, paths = family
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 2}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    prefix = "base_model.model.model.layers.0.mlp.experts.1.gate_proj"
    tensors = {f"{prefix}.lora_A.weight": np.zeros((2, 64), np.float32)}
    tensors[f"{prefix}.lora_B.weight"] = np.zeros((32, 2), np.float32)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="cannot adapt 'model.layers.0.mlp.experts.1.gate_proj'"):
        read_adapter(str(tmp_path), runner.adapter_spec)
    with pytest.raises(ValueError, match="has a LoRA bias; serve it with --enable-lora-bias"):
        read_adapter(paths[0], dataclasses.replace(runner.adapter_spec, bias=False))
