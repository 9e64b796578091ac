"""Mixture-of-experts families (Mixtral, Qwen3-MoE) against transformers on the same tiny random
weights (float32): logits at every prompt position and 32 greedy steps over a batch; both
checkpoint layouts transformers writes load to the same parameters; and expert parallelism
through the engine on an 8-device CPU mesh."""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest
from reference_checks import (
    assert_greedy_batch_matches,
    assert_logits_match_at_every_position,
    check_greedy,
)
from tiny_models import engine_kwargs, make_checkpoint, run_on_fake_devices

from jaxserve.args import EngineArgs
from jaxserve.config import ParallelConfig
from jaxserve.loader.model_loader import build_model_args, load_model
from jaxserve.models.qwen3_moe import qwen3_moe_args
from jaxserve.sharding import make_mesh

# (transformers config class, model class, overrides): 4 experts, top-2.
MOE_FAMILIES = {
    # routing weights renormalised; a window shorter than the longer test prompts
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16},
    ),
    # raw top-k routing weights (norm_topk_prob off); q/k norms, head_dim of its own
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "head_dim": 24},
    ),
}


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def tiny_moe(request, tmp_path_factory):
    """(checkpoint dir, torch reference model) in the layout `save_pretrained` writes by default."""
    path = tmp_path_factory.mktemp(request.param)
    return str(path), make_checkpoint(path, *MOE_FAMILIES[request.param], "float32", 0)


def test_logits_match_transformers_at_every_position(tiny_moe):
    assert_logits_match_at_every_position(*tiny_moe)


def test_greedy_batch_matches_transformers(tiny_moe):
    assert_greedy_batch_matches(*tiny_moe)


def _flat_params(path: str) -> dict:
    config = EngineArgs(model=path, **engine_kwargs()).create_engine_config()
    _, state = load_model(config.model_config, make_mesh(1))
    return {key: np.asarray(var.value) for key, var in state.flat_state()}


def test_stacked_expert_layout_loads_the_same_weights(tiny_moe, tmp_path):
    """The hub's per-expert tensors (the default save) and transformers' own stacked ones
    (`mlp.experts.gate_up_proj` [experts, 2 * intermediate, hidden], `save_original_format=False`)
    load to the same parameters; the stacked copy also names `num_experts` as the hub's Qwen3-MoE
    configs do."""
    from safetensors import safe_open

    path, model = tiny_moe
    model.save_pretrained(tmp_path, save_original_format=False)
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "np") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    config = json.load(open(os.path.join(tmp_path, "config.json")))
    if config["model_type"] == "qwen3_moe":
        config["num_experts"] = config.pop("num_local_experts")
        json.dump(config, open(os.path.join(tmp_path, "config.json"), "w"))
    hub, stacked = _flat_params(path), _flat_params(str(tmp_path))
    assert hub.keys() == stacked.keys() and any("expert_gate" in str(key) for key in hub)
    for key in hub:
        np.testing.assert_array_equal(hub[key], stacked[key], err_msg=str(key))


def test_refusals_name_what_is_not_supported(tiny_moe):
    path, _ = tiny_moe
    config = EngineArgs(model=path, **engine_kwargs()).create_engine_config()
    with pytest.raises(ValueError, match="experts do not split evenly over tensor_parallel_size=3"):
        build_model_args(
            config.model_config, ParallelConfig(tensor_parallel_size=3, enable_expert_parallel=True)
        )
    hf = dict(config.model_config.hf_config)
    if hf["model_type"] == "qwen3_moe":
        for mixed in ({"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}):
            with pytest.raises(ValueError, match="dense layers among the sparse ones"):
                qwen3_moe_args({**hf, **mixed}, 64)


ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from tiny_models import engine_kwargs
    from jaxserve import LLM, SamplingParams

    path, prompts = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(path, **engine_kwargs(tensor_parallel_size=4, enable_expert_parallel=True))
    gate = llm.llm_engine.runner.state["layers"]["expert_gate"].value  # [layers, experts, hidden, intermediate]
    assert {s.data.shape[1] for s in gate.addressable_shards} == {gate.shape[1] // 4}, gate.sharding
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    print(json.dumps([o.outputs[0].token_ids for o in outs]))
    """
)


@pytest.mark.parametrize("tiny_moe", ["mixtral"], indirect=True)  # one family is enough here
def test_expert_parallel_engine_matches_transformers(tiny_moe):
    """tensor_parallel_size=4 with --enable-expert-parallel, in a fresh 8-device process (the
    device count is fixed when JAX starts): greedy tokens are transformers' argmax."""
    path, model = tiny_moe
    prompts = [[5, 17, 300, 42, 9], list(range(20, 31))]
    out = run_on_fake_devices(ENGINE_SCRIPT, path, json.dumps(prompts), timeout=400)
    generated = json.loads(out.strip().splitlines()[-1])
    for prompt, tokens in zip(prompts, generated):
        compared, total = check_greedy(model, prompt, tokens)
        assert total == 8 and compared >= 6
