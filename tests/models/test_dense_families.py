"""Dense families beyond plain Llama (Mistral with a sliding window, Phi-3, Qwen2 with and
without windows, Qwen3, Gemma, Gemma 2, Gemma 3) against transformers on the same weights
(float32): logits at every prompt position, and 32 greedy steps over a batch of
mixed-length prompts (the longer ones past every window)."""

from __future__ import annotations

import pytest
from reference_checks import assert_greedy_batch_matches, assert_logits_match_at_every_position
from tiny_models import DENSE_FAMILIES, TINY_LLAMA

from jaxserve.models.registry import resolve_architecture


def test_logits_match_transformers_at_every_position(tiny_family):
    assert_logits_match_at_every_position(*tiny_family)


def test_greedy_batch_matches_transformers(tiny_family):
    assert_greedy_batch_matches(*tiny_family)


def _config(family: str) -> dict:
    import transformers

    config_cls, model_cls, overrides = DENSE_FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**TINY_LLAMA, **overrides}).to_dict()
    return {**config, "architectures": [model_cls]}


def _args(config: dict):
    return resolve_architecture(config)[1].make_args(config, 256)


# How configs on the hub, written before transformers 5, spell the same settings.
OLDER_SPELLINGS = {
    "gemma2": lambda c: {k: v for k, v in c.items() if k != "layer_types"},
    "qwen2_swa": lambda c: {k: v for k, v in c.items() if k != "layer_types"},
    "gemma3": lambda c: {
        **{k: v for k, v in c.items() if k not in ("layer_types", "rope_parameters")},
        "sliding_window_pattern": 2,
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rope_local_base_freq": 10000.0,
    },
}


@pytest.mark.parametrize("family", sorted(OLDER_SPELLINGS))
def test_older_config_spellings_give_the_same_model(family):
    config = _config(family)
    args = _args(config)
    assert _args(OLDER_SPELLINGS[family](config)) == args
    assert len(set(args.layer_windows)) == 2  # a windowed and a full layer


def test_gemma_legacy_gelu_means_the_tanh_approximation():
    config = {**_config("gemma"), "hidden_act": "gelu"}
    assert _args(config).hidden_act == "gelu_pytorch_tanh"


def test_gemma3_windowed_layers_rotate_with_their_own_base():
    args = _args(_config("gemma3"))
    assert args.layer_windows == (16, None)
    assert args.local_inv_freq is not None and args.local_inv_freq != args.inv_freq


def test_phi3_longrope_long_factors_past_the_trained_length(tmp_path):
    """Served beyond the trained length, LongRoPE uses its long factors and an attention
    factor; transformers does the same for sequences past that length, so prompts here
    are all longer than it."""
    from tiny_models import PHI3_LONGROPE, make_checkpoint

    trained = 16
    rope = {**PHI3_LONGROPE, "original_max_position_embeddings": trained}
    overrides = {**DENSE_FAMILIES["phi3_longrope"][2], "rope_parameters": rope}
    overrides["original_max_position_embeddings"] = trained
    model = make_checkpoint(tmp_path, "Phi3Config", "Phi3ForCausalLM", overrides, "float32", 0)
    assert model.model.rotary_emb.attention_scaling > 1
    assert_logits_match_at_every_position(str(tmp_path), model, lengths=(17, 45))
    assert_greedy_batch_matches(str(tmp_path), model, prompt_lens=(17, 30, 64, 20))
