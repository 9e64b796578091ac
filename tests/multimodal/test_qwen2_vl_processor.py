"""jaxserve.multimodal.qwen2_vl_processor against transformers: Qwen2VLImageProcessorPil (pixels and
grid), Qwen2VLProcessor (image token count, the expanded prompt) and Qwen2-VL's and Qwen2.5-VL's
get_rope_index (M-RoPE positions and rope delta)."""

from __future__ import annotations

import functools
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from jaxserve.multimodal.qwen2_vl_processor import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    ProcessedImage,
    Qwen2VLImageConfig,
    image_token_count,
    mrope_positions,
    process_image,
    smart_resize,
)

qwen2_vl_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
Qwen2VLImageProcessorPil = qwen2_vl_pil.Qwen2VLImageProcessorPil

# Qwen2-VL-7B-Instruct's preprocessor_config.json (Qwen2.5-VL's differs only in processor_class)
QWEN2_VL_CONFIG = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
SMALL = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16}  # at most 16 merged tokens: fast


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    bands = Image.getmodebands(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, bands), dtype=np.uint8)
    return Image.frombytes(mode, (width, height), pixels.tobytes())


def reference(images: list[Image.Image], **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """transformers' pixel_values (all images' patches, concatenated) and image_grid_thw."""
    out = Qwen2VLImageProcessorPil(**kwargs)(images=images, return_tensors="np")
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def config(checkpoint: dict | None = None, **overrides) -> Qwen2VLImageConfig:
    return Qwen2VLImageConfig.from_preprocessor_config(checkpoint or {}, {**SMALL, **overrides})


def assert_matches(image: Image.Image, cfg: Qwen2VLImageConfig, **reference_kwargs) -> ProcessedImage:
    geometry = {k: getattr(cfg, k) for k in ("patch_size", "temporal_patch_size", "merge_size")}
    bounds = {"min_pixels": cfg.min_pixels, "max_pixels": cfg.max_pixels}
    expected, grids = reference([image], **{**bounds, **geometry, **reference_kwargs})
    got = process_image(image, cfg)
    assert got.pixel_values.dtype == np.float32
    assert got.pixel_values.shape == expected.shape
    np.testing.assert_array_equal(got.pixel_values, expected)
    assert got.grid_thw == tuple(grids[0])
    t, h, w = got.grid_thw
    patch = cfg.patch_size
    assert got.pixel_values.shape == (t * h * w, 3 * cfg.temporal_patch_size * patch * patch)
    return got


# below min_pixels (30 x 40, 1 x 150), above max_pixels, odd sides, already a multiple of 28, long thin ones
SIZES = [(30, 40), (300, 200), (200, 300), (1000, 700), (57, 113), (56, 84), (601, 29), (13, 250), (150, 1)]
# (min_pixels, max_pixels): the small default; bounds that are not multiples of 28 x 28; one merged token
BOUNDS = [(56 * 56, 28 * 28 * 16), (100, 5000), (28 * 28, 28 * 28)]


@pytest.mark.parametrize("min_pixels,max_pixels", BOUNDS)
@pytest.mark.parametrize("width,height", SIZES)
def test_pixels_and_grid_match_transformers(width, height, min_pixels, max_pixels):
    image = random_image(width, height, seed=width * height)
    assert_matches(image, config(min_pixels=min_pixels, max_pixels=max_pixels))


@pytest.mark.parametrize(
    "patch_size,merge_size,temporal_patch_size", [(16, 2, 2), (14, 1, 1), (8, 3, 3), (4, 2, 1)]
)
def test_other_geometries_match_transformers(patch_size, merge_size, temporal_patch_size):
    """A checkpoint's patch size, merge size and temporal patch size (16-pixel patches, a
    merge size of 1 or 3 included) set the resize factor and the patch layout."""
    checkpoint = {
        "patch_size": patch_size,
        "merge_size": merge_size,
        "temporal_patch_size": temporal_patch_size,
    }
    factor = patch_size * merge_size
    cfg = config(checkpoint, min_pixels=factor**2, max_pixels=factor**2 * 12)
    assert cfg.factor == patch_size * merge_size
    for width, height in [(300, 200), (41, 77)]:
        assert_matches(random_image(width, height), cfg)


def test_default_and_checkpoint_settings_match_transformers():
    cfg = Qwen2VLImageConfig.from_preprocessor_config({})
    assert (cfg.min_pixels, cfg.max_pixels) == (3136, 1003520)
    got = assert_matches(random_image(1200, 900), cfg)  # 1080000 pixels: scaled below max_pixels
    assert got.grid_thw == (1, 60, 82) and 840 * 1148 <= cfg.max_pixels  # 896 x 1204 was over it
    cfg = Qwen2VLImageConfig.from_preprocessor_config(QWEN2_VL_CONFIG)
    settings = {k: v for k, v in QWEN2_VL_CONFIG.items() if not k.endswith(("_type", "_class"))}
    got = assert_matches(random_image(640, 480), cfg, **settings)
    assert got.grid_thw == (1, 34, 46)  # 476 x 644: each side rounded to the nearest multiple of 28


def test_resize_sizes_match_transformers():
    """smart_resize's (height, width) for many shapes and bounds, the 200:1 limit included."""
    rng = np.random.default_rng(1)
    shapes = [(int(h), int(w)) for h, w in rng.integers(1, 5000, (300, 2))] + [(1, 200), (200, 1), (1, 1)]
    for height, width in shapes:
        for factor, min_pixels, max_pixels in [
            (28, 3136, 1003520),
            (28, 1, 10**9),
            (32, 5000, 20000),
            (28, 784, 784),
        ]:
            try:
                expected = qwen2_vl_pil.smart_resize(height, width, factor, min_pixels, max_pixels)
            except ValueError:
                with pytest.raises(ValueError, match="aspect ratio"):
                    smart_resize(height, width, factor, min_pixels, max_pixels)
                continue
            assert smart_resize(height, width, factor, min_pixels, max_pixels) == expected


@pytest.mark.parametrize("width,height", [(201, 1), (1, 201), (4020, 20)])
def test_aspect_ratio_over_200_raises_like_transformers(width, height):
    image = random_image(width, height)
    with pytest.raises(ValueError, match="aspect ratio"):
        reference([image], **SMALL)
    with pytest.raises(ValueError, match="aspect ratio"):
        process_image(image, config())


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "CMYK", "P", "P_transparent", "RGB_transparent", "1"])
def test_image_modes_convert_to_rgb_as_transformers(mode):
    """Transparency (an alpha band, or a palette's or a colour's `transparency`) goes onto white."""
    image = random_image(45, 70, "RGBA" if mode in ("RGBA", "P_transparent") else "RGB", seed=7)
    if mode in ("LA", "L", "CMYK", "1"):
        image = random_image(45, 70, mode, seed=7) if mode != "1" else image.convert("1")
    elif mode.startswith("P"):
        image = image.convert("RGB").quantize(16)
        if mode == "P_transparent":
            image.info["transparency"] = 3
    elif mode == "RGB_transparent":
        image = image.quantize(4).convert("RGB")
        image.info["transparency"] = image.getpixel((0, 0))
    got = assert_matches(image, config())
    if mode in ("RGBA", "LA", "P_transparent", "RGB_transparent"):
        opaque = image.convert("RGB" if mode != "LA" else "L")
        opaque.info.pop("transparency", None)  # Pillow carries a palette's transparency over to RGB
        assert not np.allclose(got.pixel_values, process_image(opaque, config()).pixel_values)


def test_transparent_pixels_become_white():
    cfg = config(image_mean=0.5, image_std=0.5)
    image = Image.new("RGBA", (56, 56), (10, 200, 30, 0))
    np.testing.assert_array_equal(process_image(image, cfg).pixel_values, 1.0)
    half = process_image(Image.new("LA", (56, 56), (0, 128)), cfg).pixel_values
    np.testing.assert_allclose(half, (127 / 255 - 0.5) / 0.5, atol=1e-6)  # black at alpha 128 over white: 127


@pytest.mark.parametrize("resample", [0, 1, 2, 4, 5])
def test_resample_filter_matches_transformers(resample):
    assert_matches(random_image(300, 200), config(resample=resample), resample=resample)


def test_resize_is_on_uint8_pixels():
    """Resized as a uint8 image (each channel rounded to an integer), not as floats."""
    got = process_image(random_image(300, 200), config()).pixel_values
    cfg = config()
    mean, std = np.float32(cfg.image_mean), np.float32(cfg.image_std)
    levels = (got.reshape(-1, 3, cfg.temporal_patch_size * 14 * 14).transpose(0, 2, 1) * std + mean) * 255
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-3)


def test_mean_std_and_rescale_factor_match_transformers():
    settings = {"image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3]}
    cfg = config(rescale_factor=1 / 127.5, **settings)
    assert_matches(random_image(200, 300), cfg, rescale_factor=1 / 127.5, **settings)


def test_without_rgb_conversion():
    image = random_image(100, 60)
    assert_matches(image, config(do_convert_rgb=False), do_convert_rgb=False)
    with pytest.raises(ValueError, match="mode RGBA"):
        process_image(random_image(10, 10, "RGBA"), config(do_convert_rgb=False))
    with pytest.raises(TypeError, match="PIL image"):
        process_image(np.zeros((10, 10, 3), np.uint8), config())


def test_patch_layout():
    """Independently of transformers: an image already a multiple of 28 (not resized) comes out as its
    14 x 14 patches, the 2 x 2 patches of one merged token consecutive, each patch's row its
    channels, then 2 equal frames, then the patch's pixels row-major."""
    cfg = config(min_pixels=1, max_pixels=10**6)
    image = random_image(112, 56)  # grid 4 x 8: 2 x 4 merged tokens
    got = process_image(image, cfg)
    assert got.grid_thw == (1, 4, 8)
    mean, std = np.float32(cfg.image_mean), np.float32(cfg.image_std)
    normalized = ((np.asarray(image) * np.float32(1 / 255) - mean) / std).transpose(2, 0, 1)
    for row, patch in enumerate(got.pixel_values.reshape(-1, 3, 2, 14, 14)):
        token, within = divmod(row, 4)
        token_row, token_col = divmod(token, 4)
        y, x = (2 * token_row + within // 2) * 14, (2 * token_col + within % 2) * 14
        for frame in range(2):
            np.testing.assert_allclose(patch[:, frame], normalized[:, y : y + 14, x : x + 14], atol=1e-6)


def test_several_images_concatenate_as_transformers():
    images = [
        random_image(300, 200, seed=1),
        random_image(40, 30, "RGBA", seed=2),
        random_image(77, 500, seed=3),
    ]
    expected, grids = reference(images, **SMALL)
    got = [process_image(image, config()) for image in images]
    np.testing.assert_array_equal(np.concatenate([g.pixel_values for g in got]), expected)
    assert [g.grid_thw for g in got] == [tuple(g) for g in grids]


def replace_image_token(grid_thw: tuple[int, int, int], merge_size: int) -> str:
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    processor = SimpleNamespace(image_token=IMAGE_PAD, image_processor=SimpleNamespace(merge_size=merge_size))
    image_inputs = {"image_grid_thw": np.array([[1, 2, 2], grid_thw])}  # the second image of the batch
    return Qwen2VLProcessor.replace_image_token(processor, image_inputs, image_idx=1)


@pytest.mark.parametrize(
    "grid_thw,merge_size",
    [((1, 2, 2), 2), ((1, 4, 8), 2), ((1, 34, 46), 2), ((2, 6, 4), 2), ((1, 3, 5), 1), ((1, 9, 3), 3)],
)
def test_image_token_count_matches_transformers(grid_thw, merge_size):
    count = image_token_count(grid_thw, merge_size)
    assert IMAGE_PAD * count == replace_image_token(grid_thw, merge_size)
    assert count == np.prod(grid_thw) // merge_size**2


@pytest.mark.parametrize("width,height", [(30, 40), (300, 200), (1000, 700), (601, 29)])
def test_image_token_count_matches_transformers_count_from_size(width, height):
    """What vLLM asks the image processor for a placeholder count (get_number_of_image_patches over
    merge_size squared) is the count for the grid process_image makes."""
    cfg = config()
    grid = process_image(random_image(width, height), cfg).grid_thw
    patches = Qwen2VLImageProcessorPil(**SMALL).get_number_of_image_patches(height, width)
    assert image_token_count(grid, cfg.merge_size) == patches // cfg.merge_size**2
    with pytest.raises(ValueError):
        image_token_count((1, 3, 4), 2)  # a grid the merger cannot join


VISION_START_ID, VISION_END_ID, IMAGE_ID = 1, 2, 3


def prompt(segments: list, merge_size: int = 2) -> list[int]:
    """Token ids: an int list is text, a grid an image (vision start, its image tokens, vision end)."""
    ids = []
    for segment in segments:
        if isinstance(segment, tuple):
            ids += [VISION_START_ID] + [IMAGE_ID] * image_token_count(segment, merge_size) + [VISION_END_ID]
        else:
            ids += segment
    return ids


def rope_index(
    model: str, input_ids: list[int], grids: list, merge_size: int = 2, image_id: int = IMAGE_ID
) -> tuple[np.ndarray, int]:
    """transformers' get_rope_index for one sequence, the model's vision config reduced to its merge size."""
    import torch

    if model == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as Model
    else:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as Model
    vision = SimpleNamespace(spatial_merge_size=merge_size, tokens_per_second=2)
    model = SimpleNamespace(config=SimpleNamespace(vision_config=vision))
    model.get_vision_position_ids = functools.partial(Model.get_vision_position_ids, model)
    ids = torch.tensor([input_ids])
    positions, deltas = Model.get_rope_index(
        model,
        ids,
        mm_token_type_ids=(ids == image_id).int(),
        image_grid_thw=torch.tensor(grids) if grids else None,
    )
    return positions[:, 0].numpy(), int(deltas[0, 0])


TEXT = [[10, 11, 12], [13], [14, 15, 16, 17, 18]]
PROMPTS = {
    "text_only": [TEXT[0] + TEXT[2]],
    "one_image": [TEXT[0], (1, 4, 8), TEXT[2]],
    "tall_image_last": [TEXT[0], (1, 12, 2)],
    "image_first": [(1, 6, 4), TEXT[1]],
    "two_images": [TEXT[0], (1, 4, 8), TEXT[1], (1, 10, 2), TEXT[2]],
    "two_images_adjacent": [TEXT[0], (1, 2, 2), (1, 34, 46), TEXT[2]],
    "two_frames": [TEXT[0], (2, 4, 6), TEXT[1]],
}


@pytest.mark.parametrize("model", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_mrope_positions_match_transformers(name, model):
    segments = PROMPTS[name]
    ids, grids = prompt(segments), [s for s in segments if isinstance(s, tuple)]
    positions, delta = mrope_positions(ids, grids, IMAGE_ID, VISION_START_ID, 2)
    expected, expected_delta = rope_index(model, ids, grids)
    assert positions.dtype == np.int64 and positions.shape == (3, len(ids))
    np.testing.assert_array_equal(positions, expected)
    assert delta == expected_delta


def test_mrope_positions_with_merge_size_1_and_3_match_transformers():
    for merge in (1, 3):
        grids = [(1, 3 * merge, 2 * merge), (1, merge, 4 * merge)]
        ids = prompt([TEXT[0], grids[0], TEXT[1], grids[1]], merge)
        positions, delta = mrope_positions(ids, grids, IMAGE_ID, VISION_START_ID, merge)
        expected, expected_delta = rope_index("qwen2_vl", ids, grids, merge)
        np.testing.assert_array_equal(positions, expected)
        assert delta == expected_delta


def test_mrope_positions_layout():
    """A 4 x 8 grid is 2 x 4 merged tokens: rows and columns counted from the position after the
    text before it; the text after it resumes 4 (the longer side) later."""
    ids = prompt([[10, 11], (1, 4, 8), [12]])  # 2 text, vision start, 8 image, vision end, 1 text
    positions, delta = mrope_positions(ids, [(1, 4, 8)], IMAGE_ID, VISION_START_ID, 2)
    np.testing.assert_array_equal(positions[:, :3], [[0, 1, 2]] * 3)
    np.testing.assert_array_equal(positions[0, 3:11], [3] * 8)
    np.testing.assert_array_equal(positions[1, 3:11], [3, 3, 3, 3, 4, 4, 4, 4])
    np.testing.assert_array_equal(positions[2, 3:11], [3, 4, 5, 6, 3, 4, 5, 6])
    np.testing.assert_array_equal(positions[:, 11:], [[7, 8]] * 3)
    assert delta == 9 - 13
    empty, delta = mrope_positions([], [], IMAGE_ID, VISION_START_ID, 2)
    assert empty.shape == (3, 0) and delta == 0


@pytest.mark.parametrize(
    "ids,grids,match",
    [
        (prompt([[10], (1, 4, 8)]), [], "1 run"),
        (prompt([[10], (1, 4, 8)]), [(1, 4, 8), (1, 2, 2)], "2 image grid"),
        (prompt([[10], (1, 4, 8)]), [(1, 4, 4)], "8 image tokens"),
        ([10] + [IMAGE_ID] * 8, [(1, 4, 8)], "vision-start"),
        ([VISION_START_ID] + [IMAGE_ID] * 4, [(1, 2, 4), (1, 2, 4)], "1 run"),  # two images' tokens touch
        (prompt([[10], (1, 4, 8)]), [(1, 4, 7)], "multiples"),
        (prompt([[10], (1, 4, 8)]), [(0, 4, 8)], "positive"),
        (prompt([[10], (1, 4, 8)]), [(1, 4)], "positive"),
        ([[1, 2]], [], "sequence"),
    ],
)
def test_mrope_positions_rejects_inconsistent_prompts(ids, grids, match):
    with pytest.raises(ValueError, match=match):
        mrope_positions(ids, grids, IMAGE_ID, VISION_START_ID, 2)


@pytest.fixture(scope="module")
def qwen2_vl_processor():
    """A Qwen2VLProcessor over a word-level tokenizer that knows Qwen2-VL's vision tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    specials = [VISION_START, VISION_END, IMAGE_PAD, "<|video_pad|>"]
    vocab = {word: i for i, word in enumerate(["[UNK]", "describe", "this", "and", "that", "."] + specials)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", additional_special_tokens=specials
    )

    class Processor(Qwen2VLProcessor):  # without a video processor (whose class check needs torchvision)
        def check_argument_for_proper_class(self, argument_name, argument):
            return type(argument)

    return Processor(image_processor=Qwen2VLImageProcessorPil(**SMALL), tokenizer=tokenizer), vocab


def test_prompt_with_images_matches_qwen2_vl_processor_and_model(qwen2_vl_processor):
    """The whole path: a prompt's images processed, its image pads expanded, its M-RoPE positions,
    against Qwen2VLProcessor's input_ids, pixel_values, image_grid_thw and the model's get_rope_index."""
    processor, vocab = qwen2_vl_processor
    images = [random_image(300, 200, seed=4), random_image(30, 250, "RGBA", seed=5)]
    image = f"{VISION_START}{IMAGE_PAD}{VISION_END}"
    text = f"describe {image} and {image} this ."
    out = processor(text=[text], images=images, return_tensors="np")

    processed = [process_image(i, config()) for i in images]
    np.testing.assert_array_equal(np.concatenate([p.pixel_values for p in processed]), out["pixel_values"])
    grids = [p.grid_thw for p in processed]
    assert grids == [tuple(g) for g in out["image_grid_thw"]]
    head, *tails = text.split(image)  # each image's one pad repeated, as the server expands a prompt
    expanded = head + "".join(
        f"{VISION_START}{IMAGE_PAD * image_token_count(grid, 2)}{VISION_END}{tail}"
        for grid, tail in zip(grids, tails)
    )
    ids = processor.tokenizer(expanded)["input_ids"]
    assert ids == out["input_ids"][0].tolist()

    positions, delta = mrope_positions(ids, grids, vocab[IMAGE_PAD], vocab[VISION_START], 2)
    expected, expected_delta = rope_index("qwen2_vl", ids, grids, image_id=vocab[IMAGE_PAD])
    np.testing.assert_array_equal(
        (np.asarray(ids) == vocab[IMAGE_PAD]).astype(int), out["mm_token_type_ids"][0]
    )
    np.testing.assert_array_equal(positions, expected)
    assert delta == expected_delta


def test_config_defaults_are_transformers_class_defaults():
    cfg = Qwen2VLImageConfig.from_preprocessor_config({})
    ref = Qwen2VLImageProcessorPil
    assert (cfg.min_pixels, cfg.max_pixels) == (ref.size["shortest_edge"], ref.size["longest_edge"])
    assert (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (
        ref.patch_size,
        ref.temporal_patch_size,
        ref.merge_size,
    )
    assert cfg.do_convert_rgb is ref.do_convert_rgb and cfg.resample == int(ref.resample)
    assert cfg.rescale_factor == ref.rescale_factor
    assert cfg.image_mean == tuple(ref.image_mean) and cfg.image_std == tuple(ref.image_std)


def bounds(checkpoint: dict, overrides: dict | None = None) -> tuple[int, int]:
    cfg = Qwen2VLImageConfig.from_preprocessor_config(checkpoint, overrides)
    return cfg.min_pixels, cfg.max_pixels


def transformers_bounds(checkpoint: dict, overrides: dict | None = None) -> tuple[int, int]:
    """The bounds transformers' processor uses for a checkpoint's settings and a call's settings."""
    import warnings

    processor = Qwen2VLImageProcessorPil(
        **{k: v for k, v in checkpoint.items() if k in ("size", "min_pixels", "max_pixels")}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # min_pixels / max_pixels at call time
        size = processor._merge_and_standardize_kwargs(**(overrides or {}))["size"]
    return size.shortest_edge, size.longest_edge


@pytest.mark.parametrize(
    "checkpoint,overrides,expected",
    [
        (QWEN2_VL_CONFIG, None, (3136, 12845056)),
        ({"size": {"shortest_edge": 100, "longest_edge": 5000}}, None, (100, 5000)),
        ({"size": {"shortest_edge": 100, "longest_edge": 5000}, "min_pixels": 200}, None, (200, 5000)),
        ({"size": {"longest_edge": 5000}, "min_pixels": 200}, None, (200, 5000)),
        (
            {"size": {"min_pixels": 100, "max_pixels": 5000}, "min_pixels": 100, "max_pixels": 5000},
            None,
            (100, 5000),
        ),
        (QWEN2_VL_CONFIG, {"max_pixels": 28 * 28 * 1280}, (3136, 1003520)),
        (QWEN2_VL_CONFIG, {"min_pixels": 256 * 28 * 28, "max_pixels": 1280 * 28 * 28}, (200704, 1003520)),
        (QWEN2_VL_CONFIG, {"size": {"shortest_edge": 10, "longest_edge": 20}}, (10, 20)),
        (QWEN2_VL_CONFIG, {"size": {"shortest_edge": 10, "longest_edge": 20}, "max_pixels": 30}, (10, 30)),
        (QWEN2_VL_CONFIG, {"size": {"longest_edge": 20}, "min_pixels": 5}, (5, 20)),
    ],
)
def test_pixel_bounds_resolve_as_transformers(checkpoint, overrides, expected):
    assert bounds(checkpoint, overrides) == expected == transformers_bounds(checkpoint, overrides)


def test_older_size_spelling_is_accepted():
    """size as {"min_pixels", "max_pixels"} (older saved configs): transformers 5 leaves such a size
    without its edges when no top-level min_pixels / max_pixels come with it, and fails on resize."""
    assert bounds({"size": {"min_pixels": 100, "max_pixels": 5000}}) == (100, 5000)
    assert bounds({}, {"size": {"max_pixels": 5000, "min_pixels": 10}}) == (10, 5000)


def test_config_from_a_checkpoint_with_overrides():
    cfg = Qwen2VLImageConfig.from_preprocessor_config(QWEN2_VL_CONFIG)
    assert cfg == Qwen2VLImageConfig(
        3136,
        12845056,
        14,
        2,
        2,
        3,
        1 / 255,
        tuple(QWEN2_VL_CONFIG["image_mean"]),
        tuple(QWEN2_VL_CONFIG["image_std"]),
    )
    overridden = Qwen2VLImageConfig.from_preprocessor_config(
        QWEN2_VL_CONFIG, {"resample": 2, "image_mean": 0.5, "merge_size": 2, "do_resize": True}
    )
    assert (overridden.resample, overridden.image_mean, overridden.merge_size) == (2, (0.5,) * 3, 2)
    geometry = Qwen2VLImageConfig.from_preprocessor_config({"patch_size": 16, "merge_size": 1})
    assert (geometry.patch_size, geometry.merge_size, geometry.factor) == (16, 1, 16)


@pytest.mark.parametrize(
    "overrides,key",
    [
        ({"fps": 2}, "fps"),
        ({"longest_edge": 1024}, "longest_edge"),
        ({"size": 1024}, "size"),
        ({"size": {"height": 512, "width": 512}}, "size"),
        ({"size": {"shortest_edge": 10, "max_pixels": 20}}, "size"),
        ({"size": {}}, "size"),
        ({"size": {"longest_edge": 5000}}, "min_pixels"),
        ({"min_pixels": 0}, "min_pixels"),
        ({"max_pixels": 1e6}, "max_pixels"),
        ({"max_pixels": True}, "max_pixels"),
        ({"min_pixels": 5000, "max_pixels": 4000}, "min_pixels"),
        ({"patch_size": 16}, "patch_size"),
        ({"merge_size": 1}, "merge_size"),
        ({"temporal_patch_size": 1}, "temporal_patch_size"),
        ({"resample": 7}, "resample"),
        ({"resample": True}, "resample"),
        ({"rescale_factor": -1.0}, "rescale_factor"),
        ({"image_mean": [0.5, 0.5]}, "image_mean"),
        ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
        ({"do_convert_rgb": 1}, "do_convert_rgb"),
        ({"do_resize": False}, "do_resize"),
        ({"do_normalize": False}, "do_normalize"),
    ],
)
def test_bad_override_raises_naming_it(overrides, key):
    with pytest.raises(ValueError, match=key):
        Qwen2VLImageConfig.from_preprocessor_config(QWEN2_VL_CONFIG, overrides)


@pytest.mark.parametrize(
    "checkpoint,key",
    [
        ({"size": {"height": 512, "width": 512}}, "size"),
        ({"size": {"longest_edge": 5000}}, "min_pixels"),
        ({"merge_size": 0}, "merge_size"),
        ({"patch_size": 14.0}, "patch_size"),
        ({"min_pixels": -1}, "min_pixels"),
    ],
)
def test_bad_checkpoint_value_raises_naming_it(checkpoint, key):
    with pytest.raises(ValueError, match=key):
        Qwen2VLImageConfig.from_preprocessor_config(checkpoint)


def test_module_imports_neither_torch_nor_transformers():
    code = (
        "import sys, jaxserve.multimodal.qwen2_vl_processor\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision', 'transformers')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
