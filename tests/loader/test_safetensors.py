"""Hugging Face directories: every tensor read back equals the torch state dict, in every layout
save_pretrained produces (one file, sharded, bfloat16), and every broken layout is a ValueError
that names the file at fault."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from jaxserve.loader.safetensors import INDEX_FILE, SINGLE_FILE, iter_safetensors, read_hf_config

torch = pytest.importorskip("torch")


def _save(model, directory: str, **kwargs) -> str:
    model.save_pretrained(directory, **kwargs)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tiny_hf_model, tmp_path_factory) -> dict[str, str]:
    """One directory per layout; ``sharded`` is small enough to split into several files."""
    root = tmp_path_factory.mktemp("hf")
    bf16_model = type(tiny_hf_model)(tiny_hf_model.config)
    bf16_model.load_state_dict(tiny_hf_model.state_dict())
    return {
        "single": _save(tiny_hf_model, str(root / "single")),
        "sharded": _save(tiny_hf_model, str(root / "sharded"), max_shard_size="40KB"),
        "bf16": _save(bf16_model.to(torch.bfloat16), str(root / "bf16")),
    }


def _as_numpy(tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


@pytest.mark.parametrize("layout", ["single", "sharded", "bf16"])
def test_every_tensor_equals_the_state_dict(checkpoints, tiny_hf_model, layout):
    directory = checkpoints[layout]
    if layout == "sharded":
        assert os.path.isfile(os.path.join(directory, INDEX_FILE))
        assert len([f for f in os.listdir(directory) if f.endswith(".safetensors")]) >= 3
    dtype = torch.bfloat16 if layout == "bf16" else torch.float32
    expected = {name: _as_numpy(t.to(dtype)) for name, t in tiny_hf_model.state_dict().items()}

    got = dict(iter_safetensors(directory, use_tqdm=False))
    assert set(got) == set(expected)
    for name, array in got.items():
        assert array.dtype == expected[name].dtype, name
        assert array.shape == expected[name].shape, name
        assert array.flags.writeable, name
        np.testing.assert_array_equal(array.view(np.uint8), expected[name].view(np.uint8), err_msg=name)


def test_bf16_comes_out_as_ml_dtypes_bfloat16(checkpoints):
    name, array = next(iter(iter_safetensors(checkpoints["bf16"], use_tqdm=False)))
    assert array.dtype == np.dtype(ml_dtypes.bfloat16), name
    assert np.isfinite(array.astype(np.float32)).all()


def test_config_is_the_saved_json(checkpoints, tiny_hf_model):
    config = read_hf_config(checkpoints["single"])
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == tiny_hf_model.config.hidden_size
    with open(os.path.join(checkpoints["single"], "config.json")) as f:
        assert config == json.load(f)


# ---------------------------------------------------------------- broken directories


@pytest.fixture
def broken(tmp_path, checkpoints):
    """A fresh copy of a layout to damage."""

    def copy(layout: str) -> str:
        target = str(tmp_path / layout)
        shutil.copytree(checkpoints[layout], target)
        return target

    return copy


def _shards(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))


def test_missing_shard_is_named(broken):
    directory = broken("sharded")
    missing = _shards(directory)[1]
    os.remove(missing)
    with pytest.raises(ValueError, match=os.path.basename(missing)):
        iter_safetensors(directory, use_tqdm=False)


def test_index_naming_a_tensor_its_shard_lacks(broken):
    directory = broken("sharded")
    with open(os.path.join(directory, INDEX_FILE)) as f:
        index = json.load(f)
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = os.path.basename(_shards(directory)[0])
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        iter_safetensors(directory, use_tqdm=False)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: data[:-1], id="last-byte-missing"),
        pytest.param(lambda data: data[:5], id="shorter-than-header-length"),
        pytest.param(lambda data: b"\xff" * 8 + data[8:], id="absurd-header-length"),
        pytest.param(lambda data: data[:8] + b"!" + data[9:], id="header-not-json"),
        pytest.param(lambda data: b"", id="empty"),
    ],
)
def test_corrupt_file_is_named(broken, damage):
    directory = broken("single")
    path = os.path.join(directory, SINGLE_FILE)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(damage(data))
    with pytest.raises(ValueError, match=SINGLE_FILE):
        list(iter_safetensors(directory, use_tqdm=False))


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=str(tmp_path)):
        iter_safetensors(str(tmp_path), use_tqdm=False)
    with pytest.raises(ValueError, match="no such model directory"):
        iter_safetensors(str(tmp_path / "nope"), use_tqdm=False)


def test_missing_or_invalid_config_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json: no such file"):
        read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not a readable JSON"):
        read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json: expected a JSON object"):
        read_hf_config(str(tmp_path))
