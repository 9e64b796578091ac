"""Qwen2.5-VL's window attention as the host prepares it (numpy only): the order the vision
encoder runs an image's merged units in, and the window of each, as transformers'
get_vision_window_index gives them for one image.

A merged unit is one merge x merge block of patches (one image token). The units are cut into
windows of `window` x `window` units (window_size // spatial_merge_size // patch_size; the last
row and column of windows hold what is left), the windows taken row by row and the units of a
window row by row. The encoder reorders its patches by whole units into that order before its
blocks, and most blocks attend only within a window (the rest over the whole image); the merged
rows are put back in the processor's order after the merger.

`window_inputs` pads both to a bucket of units so that one compiled encoder serves every image
of up to that many: the padding units keep their places (after the image's) and take window -1.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

# Qwen2_5_VLVisionConfig's defaults
_WINDOW_SIZE, _PATCH_SIZE, _MERGE_SIZE = 112, 14, 2


def merger_window(vision_config: Mapping) -> int:
    """Merged units per side of a window (transformers' vit_merger_window_size) from a
    checkpoint's vision_config: window_size (pixels) // spatial_merge_size // patch_size."""
    size = vision_config.get("window_size", _WINDOW_SIZE)
    merge = vision_config.get("spatial_merge_size", _MERGE_SIZE)
    patch = vision_config.get("patch_size", _PATCH_SIZE)
    window = size // merge // patch
    if window < 1:
        raise ValueError(
            f"vision_config window_size={size} is less than one merged unit ({merge} x {patch}-pixel patches)"
        )
    return window


def window_order(grid_hw: tuple[int, int], merge: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """For an image of grid_hw patches: ([units] int64: the units in window order, as indices
    of the processor's row-major order of units; [units] int64: each one's window there, counting
    windows row by row, so that a window's units are consecutive and the ids rise)."""
    h, w = grid_hw[0] // merge, grid_hw[1] // merge
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    windows = ((rows // window) * -(-w // window) + cols // window).reshape(-1)
    order = np.argsort(windows, kind="stable")  # (stable: row-major within a window)
    return order, windows[order]


def window_inputs(
    grid_hw: tuple[int, int], merge: int, window: int, units: int
) -> tuple[np.ndarray, np.ndarray]:
    """window_order padded to `units` (the encoder's bucket of patches // merge**2), both int32:
    the padding units in their own places after the image's, in window -1."""
    order, windows = window_order(grid_hw, merge, window)
    if len(order) > units:
        raise ValueError(f"an image of {len(order)} merged units does not fit a bucket of {units}")
    index = np.arange(units, dtype=np.int32)
    index[: len(order)] = order
    ids = np.full(units, -1, np.int32)
    ids[: len(order)] = windows
    return index, ids
