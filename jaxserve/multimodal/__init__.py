"""Images for vision-language models: their processors and the items a request carries (numpy and Pillow only)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

# What stands for one image in a prompt's text, by architecture (the text the model's chat
# template writes for an image part)
_PLACEHOLDERS = {
    "Idefics3ForConditionalGeneration": "<image>",
    "Qwen2VLForConditionalGeneration": "<|vision_start|><|image_pad|><|vision_end|>",
    "Qwen2_5_VLForConditionalGeneration": "<|vision_start|><|image_pad|><|vision_end|>",
}


def image_placeholder(hf_config: Mapping) -> str | None:
    """What stands for one image in a prompt's text, or None for a model that takes no images."""
    return next((_PLACEHOLDERS[a] for a in hf_config.get("architectures") or () if a in _PLACEHOLDERS), None)


def vision_positions(grid_hw: tuple[int, int], merge: int) -> np.ndarray:
    """[h * w, 2] int32: each patch's (row, column) in the processor's block-major order (the
    merge x merge patches of a block consecutive, blocks row by row), as transformers'
    get_vision_position_ids for one frame."""
    h, w = grid_hw
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    blocks = [
        a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)
        for a in (rows, cols)
    ]
    return np.stack(blocks, axis=-1).astype(np.int32)
