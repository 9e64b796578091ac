"""Qwen2.5-VL (Qwen2-VL's decoder and prompts with a windowed vision encoder: RMSNorm, a gated
MLP, window attention in most blocks and full attention in fullatt_block_indexes) against
transformers on the same tiny random weights: the window order against get_vision_window_index,
each image's encoder rows against the model's visual module for grids of several windows (ragged
and even), whatever the padding holds, with mutations of the windows that the comparison catches;
and image+text prompts through the offline engine (two images of different sizes in one prompt
among them) giving transformers' prompt tokens, greedy tokens and logprobs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference_checks import load_vision_tower, qwen_vl_reference
from tiny_models import TINY_QWEN2_5_VL_VISION, engine_kwargs, make_qwen2_vl_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.models.qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VisionTower,
    Qwen2_5_VLVisionArgs,
    encode_image_windowed,
    vision_weight_map,
)
from jaxserve.models.qwen2_vl import split_vision_tensor  # noqa: E402
from jaxserve.multimodal import vision_positions  # noqa: E402
from jaxserve.multimodal.qwen2_5_vl_windows import merger_window, window_inputs, window_order  # noqa: E402

MERGE = 2
TINY_VISION = TINY_QWEN2_5_VL_VISION
# (h, w) in patches: 5x7 units in 3x4 windows (the last row and column short), 4x4 in exactly 2x2,
# 2x3 in 1x2, 9x4 in 5x2
GRIDS = [(10, 14), (8, 8), (4, 6), (18, 8)]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    model, image_processor = make_qwen2_vl_checkpoint(path, family="Qwen2_5_VL")
    return path, model, image_processor


def load_tower(path: Path) -> tuple[Qwen2_5_VLVisionArgs, Qwen2_5_VisionTower]:
    return load_vision_tower(
        path, Qwen2_5_VLVisionArgs, Qwen2_5_VisionTower, vision_weight_map, split_vision_tensor
    )


@pytest.fixture(scope="module")
def loaded(checkpoint):
    path, model, _ = checkpoint
    return (*load_tower(path), model)


def test_args_from_nested_and_flat_configs(checkpoint):
    path, _, _ = checkpoint
    hf = json.loads((path / "config.json").read_text())
    v = Qwen2_5_VLVisionArgs.from_hf(hf)
    assert (v.embed_dim, v.depth, v.num_heads, v.intermediate_size, v.out_hidden) == (32, 3, 2, 48, 64)
    assert (v.window_size, v.fullatt_block_indexes, v.merger_window, v.hidden_act) == (16, (1,), 2, "silu")
    assert v.merger_window == merger_window(hf["vision_config"])
    # a transformers 4 config: in_chans, no rope_parameters, the text settings at the top level
    vision = {k: val for k, val in hf["vision_config"].items() if k != "rope_parameters"}
    vision["in_chans"] = vision.pop("in_channels")
    flat = {"vision_config": vision, "hidden_size": 64, "image_token_id": v.image_token_id}
    assert Qwen2_5_VLVisionArgs.from_hf(flat) == v


def test_window_order_is_transformers():
    from transformers.vision_utils import get_vision_window_index

    for grid in GRIDS + [(2, 2), (12, 4)]:
        want_index, cu = get_vision_window_index(torch.tensor([[1, *grid]]), MERGE, 16, 4)
        index, ids = window_order(grid, MERGE, 2)
        assert np.array_equal(index, want_index.numpy()), grid
        assert np.all(np.diff(ids) >= 0)  # a window's units consecutive
        starts = np.flatnonzero(np.diff(ids, prepend=-1)) * MERGE**2
        assert np.array_equal(np.append(starts, len(ids) * MERGE**2), cu.numpy()), grid
        padded, padded_ids = window_inputs(grid, MERGE, 2, 64)
        assert padded.dtype == padded_ids.dtype == np.int32
        assert np.array_equal(padded[: len(index)], index) and np.array_equal(padded_ids[: len(ids)], ids)
        assert np.array_equal(padded[len(index) :], np.arange(len(index), 64))
        assert (padded_ids[len(ids) :] == -1).all()
    with pytest.raises(ValueError, match="does not fit"):
        window_inputs((10, 14), MERGE, 2, 16)
    with pytest.raises(ValueError, match="window_size"):
        merger_window({"window_size": 4, "patch_size": 4, "spatial_merge_size": 2})


def _patches(seed: int, grid: tuple[int, int], patch_dim: int) -> np.ndarray:
    return np.random.RandomState(seed).normal(size=(grid[0] * grid[1], patch_dim)).astype(np.float32)


def _reference(model, patches: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(patches), grid_thw=torch.tensor([[1, *grid]]))
    return out.pooler_output.numpy()


_ENCODE = nnx.jit(encode_image_windowed, static_argnums=1)


def _ours(v, tower, patches, grid, fill=None, index=None, ids=None, bucket=None):
    """encode_image_windowed (compiled) on the patches padded to a bucket (the next power of two
    by default) with `fill`'s rows (zeros by default) and the window inputs (or those given, for
    the image's units); the image's rows only."""
    count, units = grid[0] * grid[1], grid[0] * grid[1] // MERGE**2
    bucket = bucket or max(64, 1 << (count - 1).bit_length())
    pad = np.zeros((bucket - count, v.patch_dim), np.float32) if fill is None else fill(bucket - count)
    pos = np.concatenate([vision_positions(grid, MERGE), np.full((bucket - count, 2), 7, np.int32)])
    window_index, window_ids = window_inputs(grid, MERGE, v.merger_window, bucket // MERGE**2)
    if index is not None:
        window_index[:units] = index
    if ids is not None:
        window_ids[:units] = ids
    out = _ENCODE(
        tower,
        v,
        jnp.asarray(np.concatenate([patches, pad])),
        jnp.asarray(pos),
        jnp.int32(count),
        jnp.asarray(window_index),
        jnp.asarray(window_ids),
    )
    out = np.asarray(out)
    assert out.shape == (bucket // MERGE**2, v.out_hidden) and out.dtype == np.float32
    assert not out[units:].any()  # the padding's rows are zero
    return out[:units]


def test_images_match_transformers(loaded):
    v, tower, model = loaded
    for seed, grid in enumerate(GRIDS):
        patches = _patches(seed, grid, v.patch_dim)
        want = _reference(model, patches, grid)
        assert np.abs(want).max() > 0.1  # (the comparison below means something)
        np.testing.assert_allclose(_ours(v, tower, patches, grid), want, atol=2e-5, rtol=1e-5)


def test_padding_changes_nothing(loaded):
    """Whatever the padding rows hold, and whatever the bucket: the same rows (one program per
    bucket serves every image that fits it)."""
    v, tower, _ = loaded
    grid = GRIDS[0]  # 140 patches in a bucket of 256
    patches = _patches(5, grid, v.patch_dim)
    zeros = _ours(v, tower, patches, grid)
    for fill in (
        lambda n: np.random.RandomState(1).normal(scale=10.0, size=(n, v.patch_dim)).astype(np.float32),
        lambda n: np.full((n, v.patch_dim), np.nan, np.float32),
    ):
        assert np.array_equal(_ours(v, tower, patches, grid, fill=fill), zeros)
    np.testing.assert_allclose(_ours(v, tower, patches, grid, bucket=512), zeros, atol=1e-6)


def test_mutations_are_caught(loaded):
    """Each departure from transformers' windows moves the output well past the tolerance."""
    v, tower, model = loaded
    grid = GRIDS[0]
    patches = _patches(0, grid, v.patch_dim)
    want = _reference(model, patches, grid)
    units = grid[0] * grid[1] // MERGE**2
    index, ids = window_order(grid, MERGE, v.merger_window)

    def far(out):
        return np.abs(out - want).max() > 1e-3

    assert far(_ours(v, tower, patches, grid, index=np.arange(units)))  # windows, but no reordering
    assert far(_ours(v, tower, patches, grid, ids=np.zeros(units)))  # windows ignored
    assert far(_ours(v, tower, patches, grid, ids=np.arange(units)))  # each unit its own window
    no_full = dataclasses.replace(v, fullatt_block_indexes=())  # the full-attention block windowed
    assert far(_ours(no_full, tower, patches, grid))
    all_full = dataclasses.replace(v, fullatt_block_indexes=(0, 1, 2))
    assert far(_ours(all_full, tower, patches, grid))
    shifted = dataclasses.replace(v, fullatt_block_indexes=(2,))
    assert far(_ours(shifted, tower, patches, grid))
    np.testing.assert_allclose(_ours(v, tower, patches, grid), want, atol=2e-5, rtol=1e-5)


def _image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), np.uint8))


# 40x56 pixels: 10x14 patches (3x4 windows); 70x30: 18x8 (5x2); 16x24: 4x6 (1x2)
IMAGES = [_image(0, 40, 56), _image(1, 70, 30), _image(2, 16, 24)]
CASES = [
    (f"Look {PLACEHOLDER} and tell me more", [0]),
    (f"A {PLACEHOLDER} B {PLACEHOLDER} C", [1, 2]),
    ("only words", []),
]


def test_image_prompts_match_transformers(checkpoint):
    path, model, image_processor = checkpoint
    llm = LLM(model=str(path), **engine_kwargs())  # a 64-token budget: images span chunks
    tokenizer = llm.get_tokenizer()
    requests = [
        {"prompt": p, "multi_modal_data": {"image": [IMAGES[i] for i in n]}} if n else p for p, n in CASES
    ]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True)
    outs = llm.generate(requests, params, use_tqdm=False)
    for (prompt, n), out in zip(CASES, outs, strict=True):
        images = [IMAGES[i] for i in n]
        ids, tokens, first = qwen_vl_reference(model, image_processor, tokenizer, prompt, images, 8)
        assert list(out.prompt_token_ids) == ids, prompt
        assert list(out.outputs[0].token_ids) == tokens, prompt
        for token, lp in out.outputs[0].logprobs[0].items():
            assert lp.logprob == pytest.approx(first[token], abs=2e-4), (prompt, token)
