"""Whether a model is served for generation or pooling, and how it pools: --task / --runner /
--convert, a sentence-transformers folder's files, --pooler-config over them; every refusal is one
line naming what is wrong. Only configurations are built here (no weights load)."""

from __future__ import annotations

import json
import shutil

import pytest
from tiny_models import engine_kwargs, make_family_checkpoint

from jaxserve.args import EngineArgs
from jaxserve.config import PoolerConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3_flags")
    make_family_checkpoint(path, "qwen3")
    return str(path)


def config(model: str, **kw):
    return EngineArgs(model=model, **engine_kwargs(**kw)).create_engine_config()


def sentence_transformers(path, pooling: dict, extra_modules=()) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        *extra_modules,
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


@pytest.mark.parametrize(
    "flags",
    [{"task": "embed"}, {"task": "embedding"}, {"runner": "pooling"}, {"convert": "embed"}],
)
def test_pooling_is_asked_for(checkpoint, flags):
    c = config(checkpoint, **flags)
    assert c.model_config.runner_type == "pooling"
    assert c.model_config.pooler_config == PoolerConfig("LAST", True)  # a decoder's defaults
    assert not c.cache_config.enable_prefix_caching  # a mean or first token needs every token run


def test_a_generative_model_generates_unless_asked(checkpoint):
    c = config(checkpoint)
    assert c.model_config.runner_type == "generate" and c.model_config.pooler_config is None
    assert c.cache_config.enable_prefix_caching


def test_the_flag_overrides_the_folder_and_the_older_spelling(checkpoint, tmp_path):
    model = tmp_path / "st"
    shutil.copytree(checkpoint, model)
    sentence_transformers(model, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    assert config(str(model)).model_config.pooler_config == PoolerConfig("CLS", normalize=False)
    c = config(
        str(model),
        override_pooler_config={"pooling_type": "last", "normalize": True},
        pooler_config={"pooling_type": "MEAN"},
        hf_overrides={"matryoshka_dimensions": [8, 64]},
    )
    assert c.model_config.pooler_config == PoolerConfig(
        "MEAN", True, matryoshka_dimensions=(8, 64), is_matryoshka=True
    )


@pytest.mark.parametrize(
    "st, flags, message",
    [
        (None, {"task": "embed", "pooler_config": {"pooling_type": "STEP"}}, "STEP is for reward models"),
        (
            None,
            {"task": "embed", "pooler_config": {"pooling_type": "MAX"}},
            "pooling_type 'MAX' is not supported",
        ),
        (None, {"convert": "reward", "pooler_config": {"pooling_type": "MEAN"}}, "pooling_type ALL or STEP"),
        (
            None,
            {"convert": "reward", "pooler_config": {"step_tag_id": 3}},
            "step_tag_id need pooling_type STEP",
        ),
        (
            None,
            {"convert": "reward", "pooler_config": {"pooling_type": "STEP", "step_tag_id": 512}},
            r"step_tag_id must be a token id of the model \(0..511\)",
        ),
        (
            None,
            {"convert": "reward", "pooler_config": {"pooling_type": "STEP", "returned_token_ids": [1, 600]}},
            "returned_token_ids must be a list of token ids of the model",
        ),
        (None, {"convert": "reward", "pooler_config": {"normalize": True}}, r"keys \['normalize'\] are not"),
        (
            None,
            {"task": "reward", "convert": "embed"},
            "--task reward asks for --runner pooling --convert reward",
        ),
        (
            None,
            {"task": "embed", "pooler_config": {"softmax": True}},
            "keys \\['softmax'\\] are not supported",
        ),
        (None, {"pooler_config": {"pooling_type": "MEAN"}}, "--pooler-config needs a pooling model"),
        (None, {"task": "embed", "runner": "generate"}, "--task embed asks for --runner pooling"),
        (None, {"runner": "pooling", "convert": "none"}, "needs a pooling architecture"),
        (None, {"convert": "classify"}, "classify needs a \\*ForSequenceClassification checkpoint"),
        (
            None,
            {"task": "score", "convert": "embed"},
            "--task score asks for --runner pooling --convert classify",
        ),
        (
            None,
            {"runner": "pooling", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "needs a generative model",
        ),
        ({"pooling_mode_max_tokens": True}, {}, "pooling \\['pooling_mode_max_tokens'\\].*is not supported"),
        (
            {"pooling_mode_mean_tokens": True},
            {
                "extra": [
                    {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
                ]
            },
            "module 'sentence_transformers.models.Dense' \\(2_Dense\\) is not supported",
        ),
    ],
)
def test_refusals_name_what_is_wrong(checkpoint, tmp_path, st, flags, message):
    model = checkpoint
    if st is not None or "extra" in flags:
        shutil.copytree(checkpoint, tmp_path / "m")
        sentence_transformers(tmp_path / "m", st, flags.pop("extra", ()))
        model = str(tmp_path / "m")
    with pytest.raises(ValueError, match=message) as err:
        config(model, **flags)
    assert "\n" not in str(err.value)


def test_reward_models(checkpoint, tmp_path):
    """--convert reward (or --task reward) of a generative checkpoint: the hidden states of every
    token, or with STEP and returned_token_ids those tokens' LM-head rows as a two-label head
    (softmax on); a reward head of its own: its labels, and returned_token_ids index them."""
    for flags in ({"convert": "reward"}, {"task": "reward"}, {"runner": "pooling", "convert": "reward"}):
        pooler = config(checkpoint, **flags).model_config.pooler_config
        assert pooler == PoolerConfig("ALL", task="reward", activation=False)
    step = {"pooling_type": "step", "step_tag_id": 7, "returned_token_ids": [5, 9]}
    pooler = config(checkpoint, convert="reward", pooler_config=step).model_config.pooler_config
    assert pooler == PoolerConfig(
        "STEP", task="reward", labels=("5", "9"), score_token_ids=(5, 9), step_tag_id=7, activation=True
    )
    model = tmp_path / "prm"
    shutil.copytree(checkpoint, model)
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "architectures": ["Qwen2ForProcessRewardModel"]}))
    pooler = config(str(model), pooler_config={"returned_token_ids": [1]}).model_config.pooler_config
    assert pooler == PoolerConfig(
        "STEP", task="reward", labels=("LABEL_0", "LABEL_1"), reward_hidden_layer=True,
        returned_token_ids=(1,), activation=True,
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"returned_token_ids must be a list of labels of the model's head \(0..1\)"
    ):
        config(str(model), pooler_config={"returned_token_ids": [2]})
