"""Qwen2-VL / Qwen2.5-VL image preprocessing with numpy and Pillow: the pixels, the grid and the image
token count of transformers' Qwen2VLImageProcessorPil and Qwen2VLProcessor, and the M-RoPE position
ids of the model's get_rope_index, without torch or transformers.

For one image:
  1. convert to RGB, compositing any transparency (an alpha band, or a palette's or a colour's
     `transparency`) onto white;
  2. `smart_resize`: both sides become multiples of patch_size * merge_size (28), the pixel count kept
     within [min_pixels, max_pixels] and the aspect ratio kept as near as the rounding allows;
  3. scale by `rescale_factor` and normalize by `image_mean` / `image_std`, per channel;
  4. cut into patch_size x patch_size patches, each repeated temporal_patch_size times (an image is one
     frame of a video whose frames are grouped temporal_patch_size at a time), one row per patch:
     [grid_t * grid_h * grid_w, C * T * P * P] with grid_t = 1, in the vision encoder's order: the
     merge_size x merge_size patches that its merger joins into one token are consecutive rows
     (row-major), those blocks row-major over the image; a row is channel, frame, patch row, column.

The resize is Pillow's, on the uint8 RGB image, with the configured filter (BICUBIC by default), as
transformers' PIL backend does, and the rescale and normalize are its float operations in its order, so
the pixels match it bit for bit.

In the prompt an image is `<|vision_start|><|image_pad|><|vision_end|>` (the chat template's text),
its one IMAGE_PAD then repeated `image_token_count` times, as Qwen2VLProcessor does. `mrope_positions`
gives such a prompt's three rows of rotary positions (temporal, height, width) and its rope delta.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from jaxserve.multimodal.pixels import flag, per_channel, positive, resample_filter, rescale_normalize, to_rgb

BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
MAX_ASPECT_RATIO = 200  # smart_resize refuses an image whose long side is more than 200 x its short side

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"

# Qwen2VLImageProcessorPil's class defaults (OPENAI_CLIP_MEAN / _STD); size's shortest_edge and
# longest_edge are min_pixels and max_pixels
_DEFAULTS = {
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "resample": BICUBIC,
    "rescale_factor": 1 / 255,
    "image_mean": (0.48145466, 0.4578275, 0.40821073),
    "image_std": (0.26862954, 0.26130258, 0.27577711),
    "do_convert_rgb": True,
}
_PIXEL_KEYS = ("size", "min_pixels", "max_pixels")
_GEOMETRY = ("patch_size", "temporal_patch_size", "merge_size")  # the vision encoder's, not a server's choice
_ALWAYS_ON = ("do_resize", "do_rescale", "do_normalize")  # the only setting supported is True
# the two spellings of size: {"shortest_edge", "longest_edge"} (transformers 5) or {"min_pixels", "max_pixels"}
_SIZE_SPELLINGS = (
    {"shortest_edge": "min_pixels", "longest_edge": "max_pixels"},
    {"min_pixels": "min_pixels", "max_pixels": "max_pixels"},
)


@dataclass(frozen=True)
class Qwen2VLImageConfig:
    min_pixels: int  # size["shortest_edge"]: the fewest pixels a resized image has (rounding aside)
    max_pixels: int  # size["longest_edge"]: the most pixels a resized image has
    patch_size: int  # the vision encoder's patch side
    temporal_patch_size: int  # frames per patch (an image's one frame is repeated to fill them)
    merge_size: int  # the merger joins merge_size x merge_size patches into one token
    resample: int  # PIL resampling filter number
    rescale_factor: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_convert_rgb: bool = True

    @property
    def factor(self) -> int:
        """What both sides of a resized image are multiples of: one merged token's side in pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_preprocessor_config(
        cls, config: Mapping, overrides: Mapping | None = None
    ) -> Qwen2VLImageConfig:
        """From a checkpoint's preprocessor_config.json (keys other than the image processor's are
        ignored) and per-server overrides (`--mm-processor-kwargs`: an unknown key raises). A bad
        value raises ValueError naming its key; a missing one takes transformers' default.

        The pixel bounds are read as transformers does: `size` ({"shortest_edge", "longest_edge"}, or
        the older {"min_pixels", "max_pixels"}), then the top-level `min_pixels` / `max_pixels`, which
        win; an override's `size` replaces the checkpoint's whole, its `min_pixels` / `max_pixels` win
        over both. The vision encoder's geometry (patch_size, temporal_patch_size, merge_size) comes
        from the checkpoint: an override may only repeat it."""
        overrides = dict(overrides or {})
        known = set(_DEFAULTS) | set(_PIXEL_KEYS) | set(_ALWAYS_ON)
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown Qwen2-VL image processor setting(s) {unknown}; known: {sorted(known)}")
        merged = {**_DEFAULTS, **{k: v for k, v in config.items() if k in _DEFAULTS and k not in _PIXEL_KEYS}}
        for key in _GEOMETRY:
            merged[key] = _positive_int(merged[key], key)
            if key in overrides and overrides[key] != merged[key]:
                raise ValueError(
                    f"{key}={overrides[key]!r} cannot be overridden: the checkpoint's vision encoder has "
                    f"{key}={merged[key]}"
                )
        merged.update({k: v for k, v in overrides.items() if k in _DEFAULTS and k not in _PIXEL_KEYS})
        for key in _ALWAYS_ON:
            value = overrides.get(key, config.get(key, True))
            if value is not True:
                raise ValueError(f"{key}={value!r} is not supported (only True)")
        min_pixels, max_pixels = _pixel_bounds(config, overrides)
        return cls(
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            patch_size=merged["patch_size"],
            temporal_patch_size=merged["temporal_patch_size"],
            merge_size=merged["merge_size"],
            resample=resample_filter(merged["resample"]),
            rescale_factor=positive(merged["rescale_factor"], "rescale_factor"),
            image_mean=per_channel(merged["image_mean"], "image_mean"),
            image_std=per_channel(merged["image_std"], "image_std", nonzero=True),
            do_convert_rgb=flag(merged["do_convert_rgb"], "do_convert_rgb"),
        )


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # [grid_t * grid_h * grid_w, 3 * T * P * P] float32
    grid_thw: tuple[int, int, int]  # (grid_t, grid_h, grid_w) in patches; grid_t is 1 for an image


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: the (height, width) an image is resized to. Both are multiples of
    `factor`: rounded to the nearest, or, when that has more than max_pixels or fewer than min_pixels,
    scaled down (floored) or up (ceiled) by the square root of the excess. Its float arithmetic is
    transformers', so the sizes match exactly. Raises ValueError for an aspect ratio over 200."""
    if height < 1 or width < 1:
        raise ValueError(f"an image must have pixels, got {width} x {height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got "
            f"{max(height, width) / min(height, width)} ({width} x {height})"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def process_image(image: Image.Image, config: Qwen2VLImageConfig) -> ProcessedImage:
    """One image's patches and grid, as Qwen2VLImageProcessorPil makes them for `images=[image]`."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image, got {type(image).__name__}")
    rgb = to_rgb(image, config.do_convert_rgb)
    height, width = smart_resize(rgb.height, rgb.width, config.factor, config.min_pixels, config.max_pixels)
    resized = np.asarray(rgb.resize((width, height), resample=config.resample))  # [H, W, 3] uint8
    patches, grid_h, grid_w = _patchify(_normalize(resized, config), config)
    return ProcessedImage(patches, (1, grid_h, grid_w))


def image_token_count(grid_thw: Sequence[int], merge_size: int) -> int:
    """How many IMAGE_PAD tokens stand for an image of this grid in the prompt (Qwen2VLProcessor's
    replace_image_token): one per merge_size x merge_size patches."""
    t, h, w = _grid(grid_thw, merge_size)
    return t * h * w // merge_size**2


def mrope_positions(
    input_ids: Sequence[int],
    image_grid_thw: Sequence[Sequence[int]],
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:
    """A prompt's M-RoPE position ids, [3, len(input_ids)] int64 (temporal, height, width), and its rope
    delta (the largest position + 1 - len(input_ids), what later tokens' positions are offset by), as
    Qwen2-VL's and Qwen2.5-VL's get_rope_index give them for one unpadded sequence with images.

    Text tokens count up by one in all three rows. Each image is a run of exactly
    image_token_count(grid, spatial_merge_size) image tokens right after a vision-start token, its grid
    the next of `image_grid_thw`; its tokens (merged patches, row-major) all start at the position p
    after the text before it: temporal p + frame, height p + row, width p + column. The text after it
    resumes at p + max(rows, columns)."""
    ids = np.asarray(input_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"input_ids must be a sequence of token ids, got shape {ids.shape} of {ids.dtype}")
    merge = _positive_int(spatial_merge_size, "spatial_merge_size")
    grids = [_grid(g, merge) for g in image_grid_thw]
    is_image = np.concatenate(([0], (ids == image_token_id).astype(np.int8), [0]))
    starts = np.flatnonzero(np.diff(is_image) == 1)
    ends = np.flatnonzero(np.diff(is_image) == -1)
    if len(starts) != len(grids):
        raise ValueError(
            f"the prompt has {len(starts)} run(s) of image tokens but {len(grids)} image grid(s)"
        )
    positions = np.empty((3, len(ids)), dtype=np.int64)
    next_position = text_start = 0
    for index, (start, end, (t, h, w)) in enumerate(zip(starts, ends, grids)):
        rows, cols = h // merge, w // merge
        if end - start != t * rows * cols:
            raise ValueError(
                f"image {index} has {end - start} image tokens where its grid {(t, h, w)} needs {t * rows * cols}"
            )
        if start == 0 or ids[start - 1] != vision_start_token_id:
            raise ValueError(f"image {index}'s tokens (at {start}) do not follow a vision-start token")
        positions[:, text_start:start] = np.arange(start - text_start) + next_position
        next_position += start - text_start
        frame, row, col = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij")
        positions[:, start:end] = np.stack([frame.ravel(), row.ravel(), col.ravel()]) + next_position
        next_position += max(rows, cols)
        text_start = end
    positions[:, text_start:] = np.arange(len(ids) - text_start) + next_position
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions, delta


def _normalize(pixels: np.ndarray, config: Qwen2VLImageConfig) -> np.ndarray:
    """[H, W, 3] uint8 -> [3, H, W] float32 (pixels.rescale_normalize)."""
    return rescale_normalize(pixels, config.rescale_factor, config.image_mean, config.image_std).transpose(
        2, 0, 1
    )


def _patchify(image: np.ndarray, config: Qwen2VLImageConfig) -> tuple[np.ndarray, int, int]:
    """[C, H, W] -> [grid_h * grid_w, C * T * P * P]: blocks of merge x merge patches row-major, the
    patches row-major within a block; a row is channel, frame (the image repeated T times), patch
    row and column."""
    patch, merge, frames = config.patch_size, config.merge_size, config.temporal_patch_size
    channels, height, width = image.shape
    grid_h, grid_w = height // patch, width // patch
    blocks = image.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    # block row, block column, row and column in the block, channel, patch row and column
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
    repeated = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], frames, patch, patch))
    return repeated.reshape(grid_h * grid_w, channels * frames * patch * patch), grid_h, grid_w


def _grid(grid_thw, merge_size: int) -> tuple[int, int, int]:
    values = tuple(grid_thw) if isinstance(grid_thw, (Sequence, np.ndarray)) else ()
    ok = len(values) == 3 and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values
    )
    if not ok or min(values) < 1:
        raise ValueError(f"an image grid must be 3 positive ints (t, h, w), got {grid_thw!r}")
    t, h, w = (int(v) for v in values)
    if h % merge_size or w % merge_size:
        raise ValueError(
            f"an image grid's height and width must be multiples of merge size {merge_size}, got {grid_thw!r}"
        )
    return t, h, w


def _pixel_bounds(config: Mapping, overrides: Mapping) -> tuple[int, int]:
    """(min_pixels, max_pixels) from a checkpoint's config and the overrides, as transformers resolves
    size at construction (from the config) then at call time (from the overrides)."""
    base = config.get("size")
    bounds = (
        _size(base, "size") if base is not None else {k: _DEFAULTS[k] for k in ("min_pixels", "max_pixels")}
    )
    bounds.update({k: config[k] for k in ("min_pixels", "max_pixels") if config.get(k) is not None})
    if "size" in overrides:
        bounds = _size(overrides["size"], "size")
    bounds.update({k: overrides[k] for k in ("min_pixels", "max_pixels") if k in overrides})
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if key not in bounds:
            raise ValueError(f'the pixel bounds need {key} (or size["{edge}"]); got size without it')
        bounds[key] = _positive_int(bounds[key], key)
    if bounds["min_pixels"] > bounds["max_pixels"]:
        raise ValueError(
            f"min_pixels ({bounds['min_pixels']}) must not exceed max_pixels ({bounds['max_pixels']})"
        )
    return bounds["min_pixels"], bounds["max_pixels"]


def _size(value, key: str) -> dict:
    """size's bounds as {"min_pixels", "max_pixels"} (one or both), from either spelling."""
    for spelling in _SIZE_SPELLINGS:
        if isinstance(value, Mapping) and value and set(value) <= set(spelling):
            return {spelling[k]: v for k, v in value.items()}
    raise ValueError(
        f'{key} must be {{"shortest_edge": <min pixels>, "longest_edge": <max pixels>}} '
        f'(or {{"min_pixels": ..., "max_pixels": ...}}), got {value!r}'
    )


def _positive_int(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{key} must be a positive int, got {value!r}")
    return int(value)
