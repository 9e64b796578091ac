"""Idefics3 / SmolVLM image preprocessing with numpy and Pillow: the pixels and the prompt text of
transformers' Idefics3ImageProcessorPil and Idefics3Processor, without torch or transformers.

For one image:
  1. convert to RGB, compositing any transparency (an alpha band, or a palette's or a colour's
     `transparency`) onto white;
  2. resize so the longest side is `longest_edge` (up or down), the short side following the aspect
     ratio and rounded up to even, both then scaled below MAX_IMAGE_SIZE (4096);
  3. with splitting: resize again so both sides are multiples of `max_image_size` (rounded up), cut
     that into rows x cols square tiles (row-major) and append a global image, the whole resized to
     one tile; without splitting (or when it is a single tile): one tile, rows = cols = 0;
  4. scale by `rescale_factor` and normalize by `image_mean` / `image_std`, per channel.

Every resize is Pillow's, on the uint8 RGB image, with the configured filter (LANCZOS by default), as
transformers' PIL backend does, so the pixels match its to float rounding. `image_prompt` is the
text that stands for one image in the prompt (Idefics3Processor.replace_image_token).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from PIL import Image

from jaxserve.multimodal.pixels import flag, per_channel, positive, resample_filter, rescale_normalize, to_rgb

MAX_IMAGE_SIZE = 4096  # transformers' cap on either side after the first resize
LANCZOS = 1  # PIL.Image.Resampling.LANCZOS

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TAG = "<global-img>"

# Idefics3ImageProcessorPil's class defaults (IMAGENET_STANDARD_MEAN / _STD)
_DEFAULTS = {
    "size": {"longest_edge": 4 * 364},
    "max_image_size": {"longest_edge": 364},
    "do_image_splitting": True,
    "resample": LANCZOS,
    "rescale_factor": 1 / 255,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "do_convert_rgb": True,
}
_ALWAYS_ON = ("do_resize", "do_rescale", "do_normalize")  # the only setting supported is True
_NO_EFFECT = ("do_pad", "return_row_col_info")  # batch padding and output layout only


@dataclass(frozen=True)
class Idefics3ImageConfig:
    longest_edge: int  # size["longest_edge"]: the image's longest side after the first resize
    max_image_size: int  # max_image_size["longest_edge"]: a tile's side
    do_image_splitting: bool
    resample: int  # PIL resampling filter number
    rescale_factor: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_convert_rgb: bool = True

    @classmethod
    def from_preprocessor_config(
        cls, config: Mapping, overrides: Mapping | None = None
    ) -> Idefics3ImageConfig:
        """From a checkpoint's preprocessor_config.json (keys other than the image processor's are
        ignored) and per-server overrides (`--mm-processor-kwargs`: an unknown key raises). A bad
        value raises ValueError naming its key; a missing one takes transformers' default."""
        overrides = dict(overrides or {})
        known = set(_DEFAULTS) | set(_ALWAYS_ON) | set(_NO_EFFECT)
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown Idefics3 image processor setting(s) {unknown}; known: {sorted(known)}")
        merged = {**_DEFAULTS, **{k: v for k, v in config.items() if k in _DEFAULTS}}
        merged.update({k: v for k, v in overrides.items() if k in _DEFAULTS})
        for key in _ALWAYS_ON:
            value = overrides.get(key, config.get(key, True))
            if value is not True:
                raise ValueError(f"{key}={value!r} is not supported (only True)")
        return cls(
            longest_edge=_longest_edge(merged["size"], "size"),
            max_image_size=_longest_edge(merged["max_image_size"], "max_image_size"),
            do_image_splitting=flag(merged["do_image_splitting"], "do_image_splitting"),
            resample=resample_filter(merged["resample"]),
            rescale_factor=positive(merged["rescale_factor"], "rescale_factor"),
            image_mean=per_channel(merged["image_mean"], "image_mean"),
            image_std=per_channel(merged["image_std"], "image_std", nonzero=True),
            do_convert_rgb=flag(merged["do_convert_rgb"], "do_convert_rgb"),
        )


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # [tiles, 3, S, S] float32, S = max_image_size; the global image last
    rows: int  # tile rows (0 when not split)
    cols: int  # tile columns (0 when not split)


def process_image(image: Image.Image, config: Idefics3ImageConfig) -> ProcessedImage:
    """One image's tiles, as Idefics3ImageProcessorPil makes them for `images=[[image]]`."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image, got {type(image).__name__}")
    side, resample = config.max_image_size, config.resample
    rgb = to_rgb(image, config.do_convert_rgb)
    height, width = _fit_longest_edge(rgb.height, rgb.width, config.longest_edge)
    resized = rgb.resize((width, height), resample=resample)
    if config.do_image_splitting:
        height, width = _round_up_to_tiles(height, width, side)
        frames, rows, cols = _split(resized.resize((width, height), resample=resample), side, resample)
    else:
        frames, rows, cols = [np.asarray(resized.resize((side, side), resample=resample))], 0, 0
    return ProcessedImage(_normalize(np.stack(frames), config), rows, cols)


def image_prompt(rows: int, cols: int, image_seq_len: int) -> str:
    """The text that replaces one `<image>` in the prompt (Idefics3Processor.replace_image_token):
    per tile a fake token, its `<row_r_col_c>` tag and image_seq_len `<image>` tokens, a newline
    after each row, then a newline and the global image wrapped in fake tokens."""
    if rows < 0 or cols < 0 or (rows == 0) != (cols == 0):
        raise ValueError(f"rows and cols must be both 0 or both positive, got {rows} x {cols}")
    if image_seq_len < 1:
        raise ValueError(f"image_seq_len must be positive, got {image_seq_len}")
    image_tokens = IMAGE_TOKEN * image_seq_len
    global_image = f"{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TAG}{image_tokens}{FAKE_IMAGE_TOKEN}"
    if rows == 0:
        return global_image
    grid = "".join(
        "".join(f"{FAKE_IMAGE_TOKEN}<row_{r + 1}_col_{c + 1}>{image_tokens}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{grid}\n{global_image}"


def _fit_longest_edge(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """The first resize's (height, width): the longest side becomes longest_edge, the other follows
    the aspect ratio, truncated then rounded up to even; then both are scaled below MAX_IMAGE_SIZE.
    The float arithmetic is transformers' (`int(width / aspect_ratio)`), so sizes match exactly."""
    aspect_ratio = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect_ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    # _resize_output_size_scale_below_upper_bound (no even rounding here)
    aspect_ratio = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width = MAX_IMAGE_SIZE
        height = int(width / aspect_ratio)
    elif height > width and height > MAX_IMAGE_SIZE:
        height = MAX_IMAGE_SIZE
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def _round_up_to_tiles(height: int, width: int, side: int) -> tuple[int, int]:
    """resize_for_vision_encoder's (height, width): the longer side rounded up to a multiple of
    `side`, the other recomputed from the aspect ratio, then rounded up to a multiple as well."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / aspect_ratio) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * aspect_ratio) / side) * side
    return height, width


def _split(image: Image.Image, side: int, resample: int) -> tuple[list[np.ndarray], int, int]:
    """Row-major side x side tiles of an image whose sides are multiples of `side`, then the whole
    image resized to one tile; an image of one tile is returned as it is, with 0 rows and cols."""
    pixels = np.asarray(image)  # [H, W, 3] uint8
    height, width = pixels.shape[:2]
    if height <= side and width <= side:
        return [pixels], 0, 0
    rows, cols = height // side, width // side
    tiles = [
        pixels[r * side : (r + 1) * side, c * side : (c + 1) * side] for r in range(rows) for c in range(cols)
    ]
    tiles.append(np.asarray(image.resize((side, side), resample=resample)))
    return tiles, rows, cols


def _normalize(frames: np.ndarray, config: Idefics3ImageConfig) -> np.ndarray:
    """[n, H, W, 3] uint8 -> [n, 3, H, W] float32 (pixels.rescale_normalize)."""
    normalized = rescale_normalize(frames, config.rescale_factor, config.image_mean, config.image_std)
    return np.ascontiguousarray(normalized.transpose(0, 3, 1, 2))


def _longest_edge(value, key: str) -> int:
    if not isinstance(value, Mapping) or set(value) != {"longest_edge"}:
        raise ValueError(f'{key} must be {{"longest_edge": <int>}}, got {value!r}')
    edge = value["longest_edge"]
    if isinstance(edge, bool) or not isinstance(edge, int) or edge < 1:
        raise ValueError(f'{key}["longest_edge"] must be a positive int, got {edge!r}')
    return edge
