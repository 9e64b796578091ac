"""Qwen2-VL's vision encoder (models/qwen2_vl.py) against transformers' on the same tiny random
weights, loaded from a saved checkpoint through vision_weight_map and split_vision_tensor: each
image's merged rows as transformers' pooler_output, whatever the padding rows hold, and mutations
of the rope, the patch order and the merger that the comparison catches."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from reference_checks import load_vision_tower  # noqa: E402

from jaxserve.layers import vit  # noqa: E402
from jaxserve.models import qwen2_vl  # noqa: E402
from jaxserve.models.qwen2_vl import (  # noqa: E402
    Qwen2VisionTower,
    Qwen2VLVisionArgs,
    encode_image,
    split_vision_tensor,
    vision_weight_map,
)
from jaxserve.multimodal import vision_positions  # noqa: E402

GRIDS = [(4, 6), (8, 4)]  # (h, w) in patches of one frame each
MERGE = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2-VL saved to disk, its weights larger than the default initialisation (and its
    LayerNorms off the identity) so that every part of the encoder shows in its output."""
    config = transformers.Qwen2VLConfig(
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=600,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            embed_dim=32,
            depth=2,
            num_heads=2,
            patch_size=4,
            temporal_patch_size=2,
            spatial_merge_size=MERGE,
            in_channels=3,
            hidden_size=64,
            hidden_act="quick_gelu",
        ),
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("qwen2_vl")
    model.save_pretrained(path)
    return path, model


def load_tower(path: Path) -> tuple[Qwen2VLVisionArgs, Qwen2VisionTower]:
    return load_vision_tower(
        path, Qwen2VLVisionArgs, Qwen2VisionTower, vision_weight_map, split_vision_tensor
    )


@pytest.fixture(scope="module")
def loaded(checkpoint):
    path, model = checkpoint
    return (*load_tower(path), model)


def _patches(seed: int, grid: tuple[int, int], patch_dim: int) -> np.ndarray:
    return np.random.RandomState(seed).normal(size=(grid[0] * grid[1], patch_dim)).astype(np.float32)


def _reference(model, patches: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(patches), grid_thw=torch.tensor([[1, *grid]]))
    return out.pooler_output.numpy()


_ENCODE = nnx.jit(encode_image, static_argnums=1)


def _ours(v, tower, patches: np.ndarray, grid: tuple[int, int], fill=None, positions=None, encode=_ENCODE):
    """encode_image (compiled; `encode=encode_image` runs it eagerly, as a monkeypatched module
    needs) on the patches padded to the next power of two (at least merge**2) with `fill`'s rows
    (zeros by default); the valid rows only."""
    count = grid[0] * grid[1]
    bucket = max(MERGE**2, 1 << (count - 1).bit_length())
    pad = np.zeros((bucket - count, v.patch_dim), np.float32) if fill is None else fill(bucket - count)
    pos = vision_positions(grid, MERGE) if positions is None else positions
    pos = np.concatenate([pos, np.full((bucket - count, 2), 7, np.int32)])
    out = encode_image(
        tower, v, jnp.asarray(np.concatenate([patches, pad])), jnp.asarray(pos), jnp.int32(count)
    )
    out = np.asarray(out)
    assert out.shape == (bucket // MERGE**2, v.out_hidden) and out.dtype == np.float32
    assert not out[count // MERGE**2 :].any()  # the padding's rows are zero
    return out[: count // MERGE**2]


def test_args_from_nested_and_flat_configs(checkpoint):
    path, _ = checkpoint
    hf = json.loads((path / "config.json").read_text())
    v = Qwen2VLVisionArgs.from_hf(hf)
    assert (v.embed_dim, v.depth, v.num_heads, v.intermediate_size) == (32, 2, 2, 128)
    assert (v.patch_size, v.temporal_patch_size, v.in_channels, v.spatial_merge_size) == (4, 2, 3, 2)
    assert (v.hidden_act, v.rope_theta, v.out_hidden, v.image_token_id) == ("quick_gelu", 10000.0, 64, 500)
    assert v.patch_dim == 3 * 2 * 4 * 4 and not v.tp_split
    # an older, flattened config: the text hidden size at the top level, in_chans, rope_theta absent
    vision = {k: val for k, val in hf["vision_config"].items() if k not in ("hidden_size", "rope_parameters")}
    vision["in_chans"] = vision.pop("in_channels")
    flat = {"vision_config": vision, "hidden_size": 64, "image_token_id": 500}
    assert Qwen2VLVisionArgs.from_hf(flat) == v


def test_positions_are_transformers(checkpoint):
    from transformers.vision_utils import get_vision_position_ids

    for grid in GRIDS + [(2, 2), (6, 10)]:
        want = get_vision_position_ids(torch.tensor([[1, *grid]]), MERGE).numpy()
        got = vision_positions(grid, MERGE)
        assert got.dtype == np.int32 and np.array_equal(got, want), grid


def test_tensor_names_and_splits(loaded):
    v, _, _ = loaded  # (load_tower checked that the map and the checkpoint's tensors agree)
    table = vision_weight_map(v)
    assert table["visual.patch_embed.proj.weight"] == ("vision.patch_kernel", None, True)
    assert table["visual.blocks.1.attn.k.bias"] == ("vision.k_bias", 1, False)
    assert table["visual.merger.mlp.2.weight"] == ("vision.merger_fc2_kernel", None, True)
    assert "visual.blocks.0.attn.qkv.weight" not in table
    qkv = np.arange(96 * 32, dtype=np.float32).reshape(96, 32)
    parts = dict(split_vision_tensor("visual.blocks.0.attn.qkv.weight", qkv))
    assert list(parts) == [f"visual.blocks.0.attn.{p}.weight" for p in "qkv"]
    assert np.array_equal(np.concatenate(list(parts.values())), qkv)
    prefixed = vision_weight_map(v, prefix="model.visual.", ours="")
    assert prefixed["model.visual.blocks.0.norm2.bias"] == ("ln2_bias", 0, False)
    split = nnx.eval_shape(
        lambda: Qwen2VisionTower(dataclasses.replace(v, tp_split=True), jnp.float32, nnx.Rngs(0))
    )
    axes = {
        name: getattr(split, name).get_metadata()["logical_axes"]
        for name in ("q_kernel", "o_kernel", "fc2_kernel")
    }
    assert axes == {
        "q_kernel": (None, None, "vision_heads"),
        "o_kernel": (None, "vision_heads", None),
        "fc2_kernel": (None, "vision_mlp", None),
    }


def test_images_match_transformers(loaded):
    v, tower, model = loaded
    for seed, grid in enumerate(GRIDS):
        patches = _patches(seed, grid, v.patch_dim)
        want = _reference(model, patches, grid)
        assert np.abs(want).max() > 0.1  # (the comparison below means something)
        np.testing.assert_allclose(_ours(v, tower, patches, grid), want, atol=1e-5, rtol=1e-5)


def test_padding_rows_change_nothing(loaded):
    v, tower, _ = loaded
    grid = GRIDS[0]  # 24 patches in a bucket of 32
    patches = _patches(5, grid, v.patch_dim)
    zeros = _ours(v, tower, patches, grid)
    for fill in (
        lambda n: np.random.RandomState(1).normal(scale=10.0, size=(n, v.patch_dim)).astype(np.float32),
        lambda n: np.full((n, v.patch_dim), np.nan, np.float32),
    ):
        assert np.array_equal(_ours(v, tower, patches, grid, fill=fill), zeros)


def test_mutations_are_caught(loaded, monkeypatch):
    """Each departure from transformers' encoder moves the output well past the tolerance."""
    v, tower, model = loaded
    grid = GRIDS[0]
    patches = _patches(0, grid, v.patch_dim)
    want = _reference(model, patches, grid)

    def far(out):
        return np.abs(out - want).max() > 1e-3

    h, w = np.meshgrid(np.arange(grid[0]), np.arange(grid[1]), indexing="ij")
    row_major = np.stack([h.reshape(-1), w.reshape(-1)], -1).astype(np.int32)
    assert far(_ours(v, tower, patches, grid, positions=row_major))  # positions not block-major
    assert far(_ours(v, tower, patches, grid, positions=vision_positions(grid, MERGE)[:, ::-1]))  # (w, h)
    # the padding seen as keys: the bucket's rows all counted valid
    bucket = 32
    padded = np.concatenate([patches, np.ones((bucket - len(patches), v.patch_dim), np.float32)])
    pos = np.concatenate([vision_positions(grid, MERGE), np.zeros((bucket - len(patches), 2), np.int32)])
    unmasked = _ENCODE(tower, v, jnp.asarray(padded), jnp.asarray(pos), jnp.int32(bucket))
    assert far(np.asarray(unmasked)[: len(want)])

    rope = vit.apply_rope
    with monkeypatch.context() as m:  # the rotation on interleaved pairs instead of halves
        m.setattr(vit, "apply_rope", lambda x, p, f: _interleaved(rope, x, p, f))
        assert far(_ours(v, tower, patches, grid, encode=encode_image))
    merge, norm = qwen2_vl._merge, qwen2_vl.layer_norm

    def merge_without_ln(tower, v, x):
        with monkeypatch.context() as inner:
            inner.setattr(qwen2_vl, "layer_norm", lambda x, *_: x)
            return merge(tower, v, x)

    with monkeypatch.context() as m:  # the merger's LayerNorm left out
        m.setattr(qwen2_vl, "_merge", merge_without_ln)
        assert far(_ours(v, tower, patches, grid, encode=encode_image))
    assert qwen2_vl.layer_norm is norm
    np.testing.assert_allclose(_ours(v, tower, patches, grid), want, atol=1e-5, rtol=1e-5)


def _interleaved(rope, x, positions, inv_freq):
    """rope applied to the (0, 1), (2, 3), ... pairs: the halves' layout interleaved around it."""
    d = x.shape[-1]
    order = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    return rope(x[..., order], positions, inv_freq)[..., np.argsort(order)]
