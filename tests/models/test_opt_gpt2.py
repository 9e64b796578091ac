"""OPT (pre-LN, and post-LN with a narrower word embedding as in opt-350m) and GPT-2 against
transformers on the same weights (float32): logits at every prompt position, and 32 greedy
steps over a batch of mixed-length prompts. GPT-2 configs the port does not implement are
refused in one line."""

from __future__ import annotations

import json
import re

import pytest
from reference_checks import assert_greedy_batch_matches, assert_logits_match_at_every_position
from tiny_models import engine_kwargs, make_checkpoint

# (transformers config class, model class, config overrides merged over TINY_LLAMA, engine overrides)
VARIANTS = {
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 128}, {}),
    "opt_post_ln": (
        "OPTConfig",
        "OPTForCausalLM",
        {"ffn_dim": 128, "do_layer_norm_before": False, "word_embed_proj_dim": 32},
        {},
    ),
    # GPT-2 configs name their length n_positions, which the engine does not read as the
    # model's maximum length: it is passed explicitly.
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "n_inner": 128},
        {"max_model_len": 256},
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_model(request, tmp_path_factory):
    """(checkpoint dir, torch reference model, engine overrides) for each variant."""
    config_cls, model_cls, overrides, engine_overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = make_checkpoint(path, config_cls, model_cls, overrides, "float32", 0)
    return str(path), model, engine_overrides


def test_logits_match_transformers_at_every_position(tiny_model):
    path, model, engine_overrides = tiny_model
    assert_logits_match_at_every_position(path, model, **engine_overrides)


def test_greedy_batch_matches_transformers(tiny_model):
    path, model, engine_overrides = tiny_model
    assert_greedy_batch_matches(path, model, **engine_overrides)


def test_hub_tensor_names_load_like_the_transformers_ones(tiny_model):
    """Hub checkpoints name tensors without the `model.` / `transformer.` prefix (and old GPT-2
    ones carry causal-mask buffers): they must map onto the same weights."""
    import numpy as np
    from safetensors.numpy import load_file

    from jaxserve.args import EngineArgs
    from jaxserve.loader.model_loader import build_model_args

    path, _, engine_overrides = tiny_model
    config = EngineArgs(model=path, **engine_kwargs(**engine_overrides)).create_engine_config()
    entry, args = build_model_args(config.model_config)
    saved = load_file(f"{path}/model.safetensors")
    hub = {name.removeprefix("model.").removeprefix("transformer."): t for name, t in saved.items()}
    if "h.0.ln_1.weight" in hub:
        hub["h.0.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
        hub["h.0.attn.masked_bias"] = np.asarray(-1e4, np.float32)

    def mapped(tensors):
        return {n: t for name, t in tensors.items() for n, t in entry.split_tensors(name, t, args)}

    ours, from_hub = mapped(saved), mapped(hub)
    assert set(ours) == set(from_hub) == set(entry.model_cls.hf_weight_map(args))
    for name, tensor in ours.items():
        np.testing.assert_array_equal(from_hub[name], tensor)


GPT2_CONFIG = {
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 512,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 256,
}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"scale_attn_by_inverse_layer_idx": True},
            "GPT-2 models with scale_attn_by_inverse_layer_idx=True are",
        ),
        ({"add_cross_attention": True}, "GPT-2 models with add_cross_attention=True are"),
        ({"scale_attn_weights": False}, "GPT-2 models with scale_attn_weights=False are"),
    ],
)
def test_what_the_gpt2_port_does_not_implement_is_refused_in_one_line(tmp_path, overrides, message):
    from jaxserve import LLM

    (tmp_path / "config.json").write_text(json.dumps({**GPT2_CONFIG, **overrides}))
    with pytest.raises(ValueError, match=rf"^{re.escape(message)}[^\n]*\.$"):
        LLM(str(tmp_path), skip_tokenizer_init=True, **engine_kwargs(max_model_len=256))
