"""Whether a model is served as a language model or as an embedding model, and how it pools:
--runner / --convert / --task and --pooler-config, over what the model's own files say.

Where it sits: model_resolution.py calls it once, while it builds the ModelConfig. A
sentence-transformers folder (modules.json) names its pooling in 1_Pooling/config.json and its
normalization as a Normalize module; a base model's architecture (Qwen3Model, LlamaModel) has no
LM head and is served for pooling; the flag's keys come last. Every refusal is one line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from jaxserve.config import PoolerConfig
from jaxserve.flags import as_dict
from jaxserve.pooling_params import POOLING_TYPES, TOKENWISE_TYPES

# sentence-transformers module types that jaxserve applies (the transformer itself, the pooling,
# the normalization); any other (Dense projections, ...) changes the vector and is refused.
_ST_MODULES = {"Transformer": None, "Pooling": None, "Normalize": None}
# 1_Pooling/config.json's switches -> POOLING_TYPES
_ST_POOLING = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
# --pooler-config keys each pooling task takes (activation: vLLM's use_activation and its older
# spellings, softmax / sigmoid applied to a classifier's logits)
_FLAG_KEYS = {
    "embed": ("pooling_type", "normalize", "dimensions"),
    "classify": ("pooling_type", "activation", "use_activation", "softmax"),
    "reward": (
        "pooling_type",
        "step_tag_id",
        "returned_token_ids",
        "activation",
        "use_activation",
        "softmax",
    ),
}
# --task values that ask for a pooling model, and what it pools for
_TASKS = {
    "embed": "embed",
    "embedding": "embed",
    "classify": "classify",
    "score": "classify",
    "reward": "reward",
}


def runner_and_pooler(args, path: str, hf_config: Mapping) -> tuple[str, PoolerConfig | None]:
    """("generate", None) or ("pooling", the resolved PoolerConfig); ValueError naming the flag."""
    runner, convert = args.runner, args.convert
    classifier = is_classifier_architecture(hf_config)
    reward = is_reward_architecture(hf_config)
    if args.task in _TASKS:
        wanted = _TASKS[args.task]
        if runner == "generate" or convert not in ("auto", wanted):
            raise ValueError(f"--task {args.task} asks for --runner pooling --convert {wanted}.")
        runner, convert = "pooling", wanted
    st_modules = _st_modules(path)
    if runner == "auto":
        pooling = (convert in _FLAG_KEYS or st_modules is not None or classifier or reward
                   or is_base_architecture(hf_config))  # fmt: skip
        runner = "pooling" if pooling else "generate"
    if runner == "generate":
        if is_encoder(hf_config):
            raise ValueError(f"{hf_config['architectures'][0]} is an encoder: it is served for pooling only.")
        if convert not in ("auto", "none"):
            raise ValueError(f"--convert {convert} needs --runner pooling.")
        if args.pooler_config or args.override_pooler_config:
            raise ValueError("--pooler-config needs a pooling model (--runner pooling); this one generates.")
        return "generate", None
    task = "classify" if classifier else "reward" if reward or convert == "reward" else "embed"
    if convert == "none" and not (classifier or reward or is_base_architecture(hf_config)):
        raise ValueError("--runner pooling --convert none needs a pooling architecture (a base model's, "
                         "e.g. Qwen3Model); --convert embed serves a generative one for embeddings.")  # fmt: skip
    if convert not in ("auto", "none", task):
        raise ValueError(
            f"--convert {convert} of a {hf_config.get('architectures', ['?'])[0]} checkpoint is not supported "
            f"by jaxserve: it serves {task} (classify needs a *ForSequenceClassification checkpoint's score head, "
            "embed a checkpoint without a head of its own)."
        )
    return "pooling", _pooler_config(args, path, hf_config, st_modules, task)


def is_encoder(hf_config: Mapping) -> bool:
    """A BERT-style encoder (models/bert.py, models/modernbert.py): bidirectional attention,
    prompts whole in one step."""
    return hf_config.get("model_type") in ("bert", "roberta", "xlm-roberta", "modernbert")


def is_classifier_architecture(hf_config: Mapping) -> bool:
    """A sequence classifier (Qwen3ForSequenceClassification): the final hidden state through its
    score head."""
    archs = hf_config.get("architectures") or []
    return bool(archs) and archs[0].endswith("ForSequenceClassification")


def is_reward_architecture(hf_config: Mapping) -> bool:
    """A reward model with a head of its own (Qwen2ForRewardModel: a reward per token;
    Qwen2ForProcessRewardModel: two labels per reasoning step)."""
    archs = hf_config.get("architectures") or []
    return bool(archs) and archs[0].endswith(("ForRewardModel", "ForProcessRewardModel"))


def classifier_labels(hf_config: Mapping) -> tuple[str, ...]:
    """The classes in index order: a classifier of tokens' own (two: one label, the second's
    score); config.json's id2label; else LABEL_0.. for num_labels."""
    tokens = hf_config.get("classifier_from_token")
    if tokens:
        return (tokens[1],) if len(tokens) == 2 else tuple(tokens)
    id2label = hf_config.get("id2label")
    if id2label:
        return tuple(str(id2label[k]) for k in sorted(id2label, key=int))
    return tuple(f"LABEL_{i}" for i in range(int(hf_config.get("num_labels", 2))))


def is_base_architecture(hf_config: Mapping) -> bool:
    """The checkpoint is a base model (no LM head): its architecture ends in "Model" (Qwen3Model),
    not in "ForCausalLM" / "LMHeadModel"."""
    archs = hf_config.get("architectures") or []
    return bool(archs) and archs[0].endswith("Model") and not archs[0].endswith("LMHeadModel")


def _st_modules(path: str) -> list[dict] | None:
    """A sentence-transformers folder's modules.json, or None."""
    file = os.path.join(path, "modules.json") if os.path.isdir(path) else ""
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)


def _pooler_config(
    args, path: str, hf_config: Mapping, st_modules: list[dict] | None, task: str
) -> PoolerConfig:
    fields: dict = {"task": task}
    if task == "classify":
        fields.update(normalize=False, labels=classifier_labels(hf_config))
        fields["classifier_tokens"] = tuple(hf_config.get("classifier_from_token") or ())
    if is_encoder(hf_config):
        if task == "reward":
            raise ValueError("An encoder is not served as a reward model: reward models are decoders.")
        fields["pooling_type"] = "CLS"  # BERT's [CLS] (vLLM's default for encoders)
    if task == "reward":  # vLLM's defaults: a process reward model scores steps, others every token
        process = hf_config["architectures"][0].endswith("ForProcessRewardModel")
        fields["pooling_type"] = "STEP" if process else "ALL"
        if is_reward_architecture(hf_config):
            fields.update(
                reward_hidden_layer=True, labels=("LABEL_0", "LABEL_1") if process else ("LABEL_0",)
            )
    for module in st_modules or ():
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _ST_MODULES:
            raise ValueError(
                f"The model's sentence-transformers module {module.get('type')!r} ({module.get('path')}) "
                f"is not supported by jaxserve; supported: {', '.join(_ST_MODULES)}."
            )
        if kind == "Pooling":
            fields["pooling_type"] = _st_pooling_type(
                os.path.join(path, module.get("path", ""), "config.json")
            )
    if st_modules is not None:
        fields["normalize"] = any(str(m.get("type", "")).endswith("Normalize") for m in st_modules)
    flag = {**as_dict(args.override_pooler_config, "override_pooler_config"),
            **as_dict(args.pooler_config, "pooler_config")}  # fmt: skip
    unknown = sorted(set(flag) - set(_FLAG_KEYS[task]))
    if unknown:
        raise ValueError(
            f"--pooler-config keys {unknown} are not supported by jaxserve when the model serves {task}; "
            f"supported: {list(_FLAG_KEYS[task])}."
        )
    for alias in ("use_activation", "softmax"):
        if alias in flag:
            flag["activation"] = flag.pop(alias)
    fields.update(flag)
    if str(fields.get("pooling_type", "LAST")).upper() not in POOLING_TYPES:
        raise ValueError(
            f"--pooler-config pooling_type {fields['pooling_type']!r} is not supported by jaxserve; "
            f"supported: {', '.join(POOLING_TYPES)}."
        )
    fields["pooling_type"] = str(fields.get("pooling_type", "LAST")).upper()
    if task == "reward" and fields["pooling_type"] not in TOKENWISE_TYPES:
        raise ValueError("A reward model pools a row per token: pooling_type ALL or STEP.")
    if task != "reward" and fields["pooling_type"] == "STEP":
        raise ValueError("pooling_type STEP is for reward models (--convert reward).")
    if task == "reward":
        _reward_fields(fields, hf_config)
    if task == "classify" and fields["pooling_type"] == "ALL":
        raise ValueError(
            "A classifier scores one vector per prompt: pooling_type ALL is for embedding models."
        )
    if task == "classify" and is_encoder(hf_config) and fields["pooling_type"] != "CLS":
        raise ValueError("An encoder classifier's head reads its [CLS] token: pooling_type must be CLS.")
    dims = hf_config.get("matryoshka_dimensions")
    fields["matryoshka_dimensions"] = tuple(dims) if dims else None
    fields["is_matryoshka"] = bool(dims) or bool(hf_config.get("is_matryoshka"))
    return PoolerConfig(**fields)


def _reward_fields(fields: dict, hf_config: Mapping) -> None:
    """A reward model's STEP keys checked, and where its rows come from: its own head's labels,
    the LM head's rows of returned_token_ids (a generative checkpoint), or the hidden states."""
    step_keys = [k for k in ("step_tag_id", "returned_token_ids") if fields.get(k) is not None]
    if step_keys and fields["pooling_type"] != "STEP":
        raise ValueError(f"--pooler-config {', '.join(step_keys)} need pooling_type STEP.")
    vocab = int(hf_config.get("vocab_size", 0))
    step = fields.get("step_tag_id")
    if step is not None and not (isinstance(step, int) and 0 <= step < vocab):
        raise ValueError(
            f"--pooler-config step_tag_id must be a token id of the model (0..{vocab - 1}), not {step!r}."
        )
    ids = fields.get("returned_token_ids") or ()
    own = fields.get("reward_hidden_layer", False)
    bound = len(fields.get("labels", ())) if own else vocab
    if not isinstance(ids, list | tuple) or not all(isinstance(i, int) and 0 <= i < bound for i in ids):
        what = (
            f"labels of the model's head (0..{bound - 1})"
            if own
            else f"token ids of the model (0..{bound - 1})"
        )
        raise ValueError(f"--pooler-config returned_token_ids must be a list of {what}, not {ids!r}.")
    fields["returned_token_ids"] = tuple(ids)
    if ids and not own:  # the LM head's rows of those tokens become the head
        fields.update(score_token_ids=tuple(ids), returned_token_ids=(), labels=tuple(map(str, ids)))
    fields.setdefault("activation", len(fields.get("labels", ())) > 1)


def _st_pooling_type(file: str) -> str:
    """The pooling a sentence-transformers Pooling module's config.json switches on."""
    with open(file) as f:
        config = json.load(f)
    on = [name for name, value in config.items() if name.startswith("pooling_mode") and value is True]
    if len(on) != 1 or on[0] not in _ST_POOLING:
        raise ValueError(
            f"The model's sentence-transformers pooling {on} ({file}) is not supported by jaxserve; "
            f"supported: one of {', '.join(_ST_POOLING)}."
        )
    return _ST_POOLING[on[0]]
