"""What every image processor here does alike, as transformers' PIL backend does it: RGB
conversion, rescale and normalize, and the checks of an image processor config's common keys."""

from __future__ import annotations

import math
from numbers import Real

import numpy as np
from PIL import Image

RESAMPLE_FILTERS = range(6)  # PIL's NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING


def to_rgb(image: Image.Image, do_convert_rgb: bool) -> Image.Image:
    """transformers' convert_to_rgb: transparency is composited onto opaque white."""
    if not do_convert_rgb:
        if len(image.getbands()) != 3:
            raise ValueError(f"do_convert_rgb=False needs a 3-band image, got mode {image.mode}")
        return Image.fromarray(np.asarray(image))  # its bands are taken as they are, as R, G, B
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def rescale_normalize(pixels: np.ndarray, rescale_factor: float, mean, std) -> np.ndarray:
    """[..., 3] uint8 -> float32 of the same shape: rescaled in float64 and cast to float32, then
    normalized in float32, the order and precision of transformers' rescale and normalize."""
    scaled = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    return (scaled - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)


def flag(value, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def resample_filter(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in RESAMPLE_FILTERS:
        raise ValueError(f"resample must be a PIL filter number 0-5, got {value!r}")
    return int(value)


def positive(value, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 < value < math.inf:
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def per_channel(value, key: str, nonzero: bool = False) -> tuple[float, float, float]:
    values = [value] * 3 if isinstance(value, Real) and not isinstance(value, bool) else value
    ok = isinstance(values, (list, tuple)) and len(values) == 3
    ok = ok and all(isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v) for v in values)
    if not ok or (nonzero and 0 in values):
        raise ValueError(
            f"{key} must be a number or 3 finite numbers{' (not 0)' if nonzero else ''}, got {value!r}"
        )
    return tuple(float(v) for v in values)
