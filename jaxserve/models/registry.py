"""HF `architectures` name -> the model class that serves it and how its args are read.

Adding a model family is adding an entry here; nothing else in the engine branches on
the model's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.models.bert import bert_args, bert_names
from jaxserve.models.gemma import gemma2_args, gemma3_args, gemma_args
from jaxserve.models.gpt2 import gpt2_args, gpt2_names
from jaxserve.models.idefics3 import Idefics3ForConditionalGeneration, idefics3_args, idefics3_names
from jaxserve.models.llama import LlamaArgs, LlamaForCausalLM
from jaxserve.models.mixtral import mixtral_args, rename_experts
from jaxserve.models.modernbert import ModernBertArgs, ModernBertModel
from jaxserve.models.opt import OPTArgs, OPTForCausalLM, opt_names
from jaxserve.models.phi3 import split_fused
from jaxserve.models.qwen2 import qwen2_args
from jaxserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_args, qwen2_5_vl_names
from jaxserve.models.qwen2_vl import Qwen2VLForConditionalGeneration, qwen2_vl_args, qwen2_vl_names
from jaxserve.models.qwen3 import qwen3_args
from jaxserve.models.qwen3_moe import qwen3_moe_args, split_stacked_experts


@dataclass(frozen=True)
class ModelEntry:
    model_cls: type
    make_args: Callable[[Mapping, int], Any]  # (hf_config, max_model_len) -> model args
    # (checkpoint name, tensor, args) -> the tensors the weight map knows; for fused checkpoints
    split_tensors: Callable[[str, np.ndarray, Any], Iterator[tuple[str, np.ndarray]]] | None = None


_REGISTRY: dict[str, ModelEntry] = {
    # encoders and their classifiers (cross-encoders), served for pooling only (models/bert.py)
    "BertModel": ModelEntry(OPTForCausalLM, bert_args, bert_names),
    "RobertaModel": ModelEntry(OPTForCausalLM, bert_args, bert_names),
    "XLMRobertaModel": ModelEntry(OPTForCausalLM, bert_args, bert_names),
    "BertForSequenceClassification": ModelEntry(OPTForCausalLM, bert_args, bert_names),
    "RobertaForSequenceClassification": ModelEntry(OPTForCausalLM, bert_args, bert_names),
    "XLMRobertaForSequenceClassification": ModelEntry(OPTForCausalLM, bert_args, bert_names),
    "ModernBertModel": ModelEntry(ModernBertModel, ModernBertArgs.from_hf),
    "GemmaForCausalLM": ModelEntry(LlamaForCausalLM, gemma_args),
    "Gemma2ForCausalLM": ModelEntry(LlamaForCausalLM, gemma2_args),
    "Gemma3ForCausalLM": ModelEntry(LlamaForCausalLM, gemma3_args),
    "GPT2LMHeadModel": ModelEntry(OPTForCausalLM, gpt2_args, gpt2_names),
    # vision-language: an image encoder before the Llama decoder (models/idefics3.py)
    "Idefics3ForConditionalGeneration": ModelEntry(
        Idefics3ForConditionalGeneration, idefics3_args, idefics3_names
    ),
    "Qwen2VLForConditionalGeneration": ModelEntry(
        Qwen2VLForConditionalGeneration, qwen2_vl_args, qwen2_vl_names
    ),
    "Qwen2_5_VLForConditionalGeneration": ModelEntry(
        Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_args, qwen2_5_vl_names
    ),
    "LlamaForCausalLM": ModelEntry(LlamaForCausalLM, LlamaArgs.from_hf),
    "MistralForCausalLM": ModelEntry(LlamaForCausalLM, LlamaArgs.from_hf),
    "MixtralForCausalLM": ModelEntry(LlamaForCausalLM, mixtral_args, rename_experts),
    "OPTForCausalLM": ModelEntry(OPTForCausalLM, OPTArgs.from_hf, opt_names),
    "Phi3ForCausalLM": ModelEntry(LlamaForCausalLM, LlamaArgs.from_hf, split_fused),
    "Qwen2ForCausalLM": ModelEntry(LlamaForCausalLM, qwen2_args),
    # reward models (served for pooling: a reward head over each token; config.PoolerConfig)
    "Qwen2ForRewardModel": ModelEntry(LlamaForCausalLM, qwen2_args),
    "Qwen2ForProcessRewardModel": ModelEntry(LlamaForCausalLM, qwen2_args),
    "Qwen3ForCausalLM": ModelEntry(LlamaForCausalLM, qwen3_args),
    "Qwen3MoeForCausalLM": ModelEntry(LlamaForCausalLM, qwen3_moe_args, split_stacked_experts),
}
# Base models (no LM head; their tensors lack the "model." prefix), served for pooling: the same
# layers as the generative class of the family.
_REGISTRY |= {
    name.replace("ForCausalLM", "Model"): entry
    for name, entry in list(_REGISTRY.items())
    if name.endswith("ForCausalLM") and entry.model_cls is LlamaForCausalLM
}
_REGISTRY["Gemma3TextModel"] = _REGISTRY.pop("Gemma3Model")  # (transformers' name for the text-only one)
# Sequence classifiers: the family's layers, then a score head (no LM head) over the last token.
_REGISTRY |= {
    name.replace("ForCausalLM", "ForSequenceClassification"): entry
    for name, entry in list(_REGISTRY.items())
    if name.endswith("ForCausalLM") and entry.model_cls is LlamaForCausalLM
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def resolve_architecture(hf_config: Mapping) -> tuple[str, ModelEntry]:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _REGISTRY:
            return arch, _REGISTRY[arch]
    raise ValueError(
        f"Model architecture(s) {archs or '(none given)'} not supported by jaxserve; "
        f"supported: {', '.join(supported_architectures())}."
    )
