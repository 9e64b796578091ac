"""jaxserve.multimodal.idefics3_processor against transformers' Idefics3ImageProcessorPil (pixels, tile
rows and cols) and Idefics3Processor.replace_image_token (the prompt text of one image)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from jaxserve.multimodal.idefics3_processor import (
    MAX_IMAGE_SIZE,
    Idefics3ImageConfig,
    ProcessedImage,
    _fit_longest_edge,
    image_prompt,
    process_image,
)

idefics3_pil = pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")
Idefics3ImageProcessorPil = idefics3_pil.Idefics3ImageProcessorPil

# A SmolVLM checkpoint's preprocessor_config.json (with the keys it carries beside the image processor's)
SMOLVLM_CONFIG = {
    "do_convert_rgb": True,
    "do_image_splitting": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Idefics3ImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": 512},
    "processor_class": "Idefics3Processor",
    "resample": 1,
    "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 2048},
    "video_sampling": {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": 512}},
}


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    bands = Image.getmodebands(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, bands), dtype=np.uint8)
    return Image.frombytes(mode, (width, height), pixels.tobytes())


def reference(image: Image.Image, **kwargs) -> tuple[np.ndarray, int, int]:
    """transformers' tiles of one image (a batch of one is not padded), its rows and cols."""
    out = Idefics3ImageProcessorPil(**kwargs)(images=[[image]], return_row_col_info=True, return_tensors="np")
    return np.asarray(out["pixel_values"][0]), out["rows"][0][0], out["cols"][0][0]


def config(longest_edge: int, max_image_size: int, split: bool = True, **more) -> Idefics3ImageConfig:
    overrides = {
        "size": {"longest_edge": longest_edge},
        "max_image_size": {"longest_edge": max_image_size},
        "do_image_splitting": split,
        **more,
    }
    return Idefics3ImageConfig.from_preprocessor_config({}, overrides)


def assert_matches(image: Image.Image, cfg: Idefics3ImageConfig, **reference_kwargs) -> ProcessedImage:
    expected, rows, cols = reference(
        image,
        size={"longest_edge": cfg.longest_edge},
        max_image_size={"longest_edge": cfg.max_image_size},
        do_image_splitting=cfg.do_image_splitting,
        **reference_kwargs,
    )
    got = process_image(image, cfg)
    side = cfg.max_image_size
    assert got.pixel_values.dtype == np.float32
    assert got.pixel_values.shape == expected.shape == (rows * cols + 1, 3, side, side)
    np.testing.assert_allclose(got.pixel_values, expected, rtol=0, atol=1e-5)
    assert (got.rows, got.cols) == (rows, cols)
    return got


SIZES = [(37, 53), (300, 200), (200, 300), (512, 512), (1000, 700), (4000, 90), (90, 4000), (33, 32)]
# (longest_edge, max_image_size): 32-pixel tiles; 30-pixel tiles that do not divide the longest edge;
# one tile bigger than the longest edge; an odd longest edge
SETTINGS = [(96, 32), (100, 30), (50, 64), (99, 33)]


@pytest.mark.parametrize("split", [True, False], ids=["split", "no_split"])
@pytest.mark.parametrize("longest_edge,max_image_size", SETTINGS)
@pytest.mark.parametrize("width,height", SIZES)
def test_pixels_rows_and_cols_match_transformers(width, height, longest_edge, max_image_size, split):
    image = random_image(width, height, seed=width * height)
    got = assert_matches(image, config(longest_edge, max_image_size, split))
    if not split:
        assert got.pixel_values.shape[0] == 1 and (got.rows, got.cols) == (0, 0)


def test_default_settings_match_transformers():
    cfg = Idefics3ImageConfig.from_preprocessor_config({})
    assert (cfg.longest_edge, cfg.max_image_size) == (1456, 364)
    got = assert_matches(random_image(1000, 700), cfg)
    assert (got.rows, got.cols) == (3, 4)  # 1456 x 1020 -> 1456 x 1092


def test_the_grid_follows_processing_not_a_size_formula():
    """33 x 32 at longest edge 33 is 33 x 32 after the first resize, but resize_for_vision_encoder
    recomputes the short side from the rounded-up long side (64 / (33 / 32) = 62 -> 64): 2 x 2 tiles,
    where transformers' own get_number_of_image_patches says 1 x 2."""
    got = assert_matches(random_image(33, 32), config(33, 32))
    assert (got.rows, got.cols) == (2, 2)
    # a square image at an odd longest edge is one pixel taller than wide (99 -> 100, rounded to even)
    got = assert_matches(random_image(512, 512), config(99, 33))
    assert (got.rows, got.cols) == (4, 4)


@pytest.mark.parametrize("width,height", [(4000, 90), (90, 4000)])
def test_sides_are_capped_at_max_image_size(width, height):
    """A longest edge over 4096 is scaled back to 4096 (the short side truncated, not made even)."""
    image = random_image(width, height)
    assert_matches(image, config(5000, 512, split=False))
    got = assert_matches(image, config(5000, 512))
    assert max(got.rows, got.cols) * 512 == MAX_IMAGE_SIZE


def test_first_resize_sizes_match_transformers():
    """The first resize's size, for many shapes and longest edges, over MAX_IMAGE_SIZE included."""
    rng = np.random.default_rng(1)
    shapes = [(h, w) for h, w in rng.integers(1, 6000, (300, 2))] + [(1, 5000), (5000, 1), (777, 777)]
    for height, width in shapes:
        for longest_edge in (1, 33, 96, 99, 1456, 4095, 4097, 5001, 9000):
            expected = idefics3_pil.get_resize_output_image_size(np.empty((1, height, width)), longest_edge)
            assert _fit_longest_edge(int(height), int(width), longest_edge) == expected


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "CMYK", "P", "P_transparent", "RGB_transparent", "1"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "no_split"])
def test_image_modes_convert_to_rgb_as_transformers(mode, split):
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
    got = assert_matches(image, config(96, 32, split))
    if mode in ("RGBA", "LA", "P_transparent", "RGB_transparent"):
        opaque = image.convert("RGB" if mode != "LA" else "L")
        opaque.info.pop("transparency", None)  # Pillow carries a palette's transparency over to RGB
        opaque = process_image(opaque, config(96, 32, split))
        assert not np.allclose(got.pixel_values, opaque.pixel_values)  # the alpha was not dropped


def test_transparent_pixels_become_white():
    image = Image.new("RGBA", (40, 30), (10, 200, 30, 0))
    np.testing.assert_array_equal(process_image(image, config(96, 32)).pixel_values, 1.0)
    half = process_image(Image.new("LA", (40, 30), (0, 128)), config(96, 32, split=False)).pixel_values
    np.testing.assert_allclose(half, (127 / 255 - 0.5) / 0.5, atol=1e-6)  # black at alpha 128 over white: 127


@pytest.mark.parametrize("resample", [0, 2, 3, 4, 5])
def test_resample_filter_matches_transformers(resample):
    assert_matches(random_image(300, 200), config(96, 32, resample=resample), resample=resample)


def test_mean_std_and_rescale_factor_match_transformers():
    settings = {
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    cfg = config(96, 32, rescale_factor=1 / 127.5, **settings)
    assert_matches(random_image(200, 300), cfg, rescale_factor=1 / 127.5, **settings)


def test_without_rgb_conversion():
    image = random_image(100, 60)
    assert_matches(image, config(64, 32, do_convert_rgb=False), do_convert_rgb=False)
    with pytest.raises(ValueError, match="mode RGBA"):
        process_image(random_image(10, 10, "RGBA"), config(64, 32, do_convert_rgb=False))
    with pytest.raises(TypeError, match="PIL image"):
        process_image(np.zeros((10, 10, 3), np.uint8), config(64, 32))


def replace_image_token(rows: int, cols: int, image_seq_len: int) -> str:
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    processor = SimpleNamespace(
        fake_image_token="<fake_token_around_image>",
        image_token="<image>",
        global_image_tag="<global-img>",
        image_seq_len=image_seq_len,
    )
    image_inputs = {"rows": [[5], [rows]], "cols": [[5], [cols]]}  # the second image of the batch
    return Idefics3Processor.replace_image_token(processor, image_inputs, image_idx=1)


@pytest.mark.parametrize("rows,cols", [(0, 0), (1, 1), (1, 3), (3, 2), (4, 4)])
@pytest.mark.parametrize("image_seq_len", [1, 3, 64])
def test_image_prompt_matches_transformers(rows, cols, image_seq_len):
    assert image_prompt(rows, cols, image_seq_len) == replace_image_token(rows, cols, image_seq_len)


def test_image_prompt_layout():
    assert (
        image_prompt(0, 0, 2)
        == "<fake_token_around_image><global-img><image><image><fake_token_around_image>"
    )
    assert image_prompt(1, 2, 1) == (
        "<fake_token_around_image><row_1_col_1><image><fake_token_around_image><row_1_col_2><image>\n"
        "\n<fake_token_around_image><global-img><image><fake_token_around_image>"
    )
    for rows, cols, seq_len in [(0, 2, 1), (-1, -1, 1), (1, 1, 0)]:
        with pytest.raises(ValueError):
            image_prompt(rows, cols, seq_len)


def test_config_defaults_are_transformers_class_defaults():
    cfg = Idefics3ImageConfig.from_preprocessor_config({})
    ref = Idefics3ImageProcessorPil
    assert cfg.longest_edge == ref.size["longest_edge"]
    assert cfg.max_image_size == ref.max_image_size["longest_edge"]
    assert cfg.do_image_splitting is ref.do_image_splitting and cfg.do_convert_rgb is ref.do_convert_rgb
    assert cfg.resample == int(ref.resample)
    assert cfg.rescale_factor == ref.rescale_factor
    assert cfg.image_mean == tuple(ref.image_mean) and cfg.image_std == tuple(ref.image_std)


def test_config_from_a_checkpoint_with_overrides():
    cfg = Idefics3ImageConfig.from_preprocessor_config(SMOLVLM_CONFIG)
    assert cfg == Idefics3ImageConfig(2048, 512, True, 1, 1 / 255, (0.5,) * 3, (0.5,) * 3, True)
    overridden = Idefics3ImageConfig.from_preprocessor_config(
        SMOLVLM_CONFIG,
        {
            "do_image_splitting": False,
            "size": {"longest_edge": 1024},
            "max_image_size": {"longest_edge": 384},
        },
    )
    assert (overridden.do_image_splitting, overridden.longest_edge, overridden.max_image_size) == (
        False,
        1024,
        384,
    )
    assert overridden.resample == 1 and overridden.image_mean == (0.5,) * 3
    assert Idefics3ImageConfig.from_preprocessor_config({}, {"image_mean": 0.25}).image_mean == (0.25,) * 3
    assert Idefics3ImageConfig.from_preprocessor_config({}, {"do_pad": False}).longest_edge == 1456


@pytest.mark.parametrize(
    "overrides,key",
    [
        ({"video_sampling": {}}, "video_sampling"),
        ({"longest_edge": 1024}, "longest_edge"),
        ({"size": 1024}, "size"),
        ({"size": {"height": 512, "width": 512}}, "size"),
        ({"size": {"longest_edge": 512, "shortest_edge": 256}}, "size"),
        ({"max_image_size": {"longest_edge": 0}}, "max_image_size"),
        ({"max_image_size": {"longest_edge": 32.0}}, "max_image_size"),
        ({"do_image_splitting": "false"}, "do_image_splitting"),
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
        Idefics3ImageConfig.from_preprocessor_config(SMOLVLM_CONFIG, overrides)


def test_bad_checkpoint_value_raises_naming_it():
    with pytest.raises(ValueError, match="max_image_size"):
        Idefics3ImageConfig.from_preprocessor_config({**SMOLVLM_CONFIG, "max_image_size": {"height": 512}})


def test_module_imports_neither_torch_nor_transformers():
    code = (
        "import sys, jaxserve.multimodal.idefics3_processor\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision', 'transformers')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
