"""Checkpoints quantized by other tools (quant_method fp8, compressed-tensors) against transformers.

Each checkpoint is written here the way those tools write it: a tiny random Llama whose decoder
projections are quantized in torch (fp8 per tensor with a static input scale, fp8 in blocks of
32 x 32 with `weight_scale_inv`, compressed-tensors fp8 per channel with bfloat16 scales and int8
per group of 32 inputs), the scales beside the values. The reference is transformers with every
projection replaced by what the checkpoint stands for (values times scales): jaxserve's logits
must equal it at every prompt position, with the values served as stored (int8 or fp8 in
memory, not dequantized).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from reference_checks import assert_greedy_generation_matches, prompt_logits, teacher_forced_logits
from tiny_models import engine_kwargs, make_llama_checkpoint

from jaxserve import LLM
from jaxserve.args import EngineArgs
from jaxserve.runner.model_runner import ModelRunner

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# name: (quantization_config, {projection: the format it is served in})
SCHEMES = {
    "fp8-per-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, "fp8"),
    "fp8-blocks": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
        "fp8/32",
    ),
    "ct-fp8-channel": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "dynamic": True,
                    },
                }
            },
            "ignore": ["lm_head"],
        },
        "fp8",
    ),
    "ct-int8-group": (
        {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "int",
                        "strategy": "group",
                        "group_size": 32,
                        "symmetric": True,
                    },
                }
            },
            # one layer's down_proj kept in float: down_proj is then served dequantized in every layer
            "ignore": ["lm_head", "model.layers.0.mlp.down_proj"],
        },
        "int8/32",
    ),
}


def _quantize(w, scheme: str):
    """torch [out, in] -> ({suffix: tensor} as the checkpoint stores it, what it stands for)."""
    import torch

    if scheme == "fp8-per-tensor":
        scale = w.abs().max() / 448
        values = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": values, "weight_scale": scale.reshape(()), "input_scale": torch.tensor(0.5)}, (
            values.float() * scale
        )
    if scheme == "fp8-blocks":
        out, d_in = w.shape
        blocks = w.reshape(out // 32, 32, d_in // 32, 32)
        scale = blocks.abs().amax(dim=(1, 3)) / 448  # [out / 32, in / 32]
        full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
        values = (w / full).to(torch.float8_e4m3fn)
        return {"weight": values, "weight_scale_inv": scale}, values.float() * full
    if scheme == "ct-fp8-channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / 448).to(torch.bfloat16)  # stored in bfloat16
        values = (w / scale.float()).to(torch.float8_e4m3fn)
        return {"weight": values, "weight_scale": scale}, values.float() * scale.float()
    out, d_in = w.shape
    groups = w.reshape(out, d_in // 32, 32)
    scale = groups.abs().amax(dim=2) / 127  # [out, in / 32]
    values = (groups / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    return {"weight": values.reshape(out, d_in), "weight_scale": scale}, (
        (values.float() * scale[..., None]).reshape(out, d_in)
    )


def write_quantized_checkpoint(source: str, model, target, scheme: str):
    """The float checkpoint at `source` (its torch `model`) quantized as `scheme` into `target`;
    returns the torch model of what the quantized checkpoint stands for."""
    import copy

    import torch
    from safetensors.torch import save_file

    config, _ = SCHEMES[scheme]
    ignore = set(config.get("ignore", ()))
    shutil.copytree(source, target)
    reference = copy.deepcopy(model)
    tensors = {}
    with torch.no_grad():
        for name, param in reference.state_dict().items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module.split(".")[-1] in PROJECTIONS and module not in ignore:
                stored, stands_for = _quantize(param.float(), scheme)
                tensors.update({f"{module}.{k}": v.contiguous() for k, v in stored.items()})
                param.copy_(stands_for)
            else:
                tensors[name] = param.contiguous()
    if "lm_head.weight" in tensors and reference.config.tie_word_embeddings:
        del tensors["lm_head.weight"]
    save_file(tensors, str(target / "model.safetensors"))
    hf = json.loads((target / "config.json").read_text())
    hf["quantization_config"] = config
    (target / "config.json").write_text(json.dumps(hf))
    return reference


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("prequant-source")
    return str(path), make_llama_checkpoint(path, "gqa")


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_logits_equal_transformers_with_what_the_checkpoint_stores(llama, tmp_path, scheme):
    source, model = llama
    reference = write_quantized_checkpoint(source, model, tmp_path / "q", scheme)
    config = EngineArgs(model=str(tmp_path / "q"), **engine_kwargs()).create_engine_config()
    assert config.model_config.checkpoint_quantization == SCHEMES[scheme][0]["quant_method"]
    runner = ModelRunner(config)
    rng = np.random.default_rng(0)
    for n in (1, 9, 45):
        ids = rng.integers(3, 500, size=n).tolist()
        np.testing.assert_allclose(
            prompt_logits(runner, ids),
            teacher_forced_logits(reference, ids),
            atol=1e-4,
            rtol=0,
            err_msg=f"{n}",
        )
    # served as stored: the checkpoint's values and their scales, not a float copy
    fmt = SCHEMES[scheme][1]
    stored = "int8" if fmt.startswith("int8") else "float8_e4m3fn"
    flat = {".".join(map(str, k)): v.value for k, v in runner.state.flat_state()}
    for proj in PROJECTIONS:
        kernel = flat[f"layers.{proj}"]
        if scheme == "ct-int8-group" and proj == "down_proj":  # float in one layer: dequantized
            assert str(kernel.dtype) == "float32" and f"layers.{proj}_scale" not in flat
            continue
        assert str(kernel.dtype) == stored, proj
        scale = flat[f"layers.{proj}_scale"]
        if "/" in fmt:  # a scale per group of inputs and output channel
            assert scale.shape == (2, kernel.shape[1] // 32, kernel.shape[2]), proj
        else:
            assert scale.shape == (2, kernel.shape[2]), proj


def test_greedy_generation_with_block_scales(llama, tmp_path):
    source, model = llama
    reference = write_quantized_checkpoint(source, model, tmp_path / "q", "fp8-blocks")
    llm = LLM(str(tmp_path / "q"), **engine_kwargs())
    assert_greedy_generation_matches(llm, reference, [[5, 6, 7], list(range(20, 61))], max_tokens=16)


def test_kv_cache_scales_come_from_the_checkpoint(llama, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    source, model = llama
    write_quantized_checkpoint(source, model, tmp_path / "q", "fp8-per-tensor")
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"))
    args = EngineArgs(model=str(tmp_path / "q"), kv_cache_dtype="fp8", **engine_kwargs())
    np.testing.assert_array_equal(
        ModelRunner(args.create_engine_config()).kv_scales, [[0.25, 0.5], [2.0, 2.0]]
    )


@pytest.mark.parametrize(
    "change, error",
    [
        ({"quant_method": "awq"}, "'awq'"),
        ({"format": "pack-quantized"}, "compressed-tensors format 'pack-quantized'"),
        ({"symmetric": False}, "zero points"),
        ({"num_bits": 4}, "weights of 4 bits"),
    ],
)
def test_what_cannot_be_read_is_refused_in_one_line(llama, tmp_path, change, error):
    source, model = llama
    write_quantized_checkpoint(source, model, tmp_path / "q", "ct-int8-group")
    hf = json.loads((tmp_path / "q" / "config.json").read_text())
    qc = hf["quantization_config"]
    for key, value in change.items():
        if key in qc:
            qc[key] = value
        else:
            qc["config_groups"]["group_0"]["weights"][key] = value
    (tmp_path / "q" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=error) as err:
        EngineArgs(model=str(tmp_path / "q"), **engine_kwargs()).create_engine_config()
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        write_quantized_checkpoint(source, model, tmp_path / "f", "fp8-per-tensor")
        EngineArgs(model=str(tmp_path / "f"), quantization="int8", **engine_kwargs()).create_engine_config()
