"""A request's images: from Pillow images and a prompt to the prompt's token ids with each image's
placeholder tokens expanded, the processed tiles each image's encoder rows come from, and where
those rows go.

The flow: `ImagePrompts.expand` (the engine's InputProcessor) checks the images against the
prompt's placeholders and `--limit-mm-per-prompt`, processes each (the model's image processor,
reproduced without torch) and writes the expanded prompt; `RequestImages` rides on the request;
each step's chunk of a prompt carries `RequestImages.rows_for(start, end)` (an `ImageRows`: which
images, which of their rows, at which of the chunk's tokens), and the runner turns that into the
rows fed in place of those tokens' embeddings (runner/image_encoder.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxserve.multimodal import image_placeholder
from jaxserve.multimodal.idefics3_processor import Idefics3ImageConfig, image_prompt, process_image

# vLLM's default: this many items of a modality per prompt unless --limit-mm-per-prompt says less
DEFAULT_LIMIT = 999


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image as the encoder takes it."""

    digest: bytes  # sha256 of the image's mode, size and pixels and the processor's settings
    pixel_values: np.ndarray  # [tiles, channels, side, side] float32
    num_rows: int  # the rows the encoder makes of it: tiles * rows per tile


@dataclass(frozen=True, eq=False)
class ImageRows:
    """A step's share of a request's image rows: rows [first_row, first_row + len(offsets)) of
    the concatenated rows of `items`, fed at the chunk's tokens `offsets` (from its first)."""

    items: tuple[ImageItem, ...]
    first_row: int
    offsets: np.ndarray  # [rows] int32


@dataclass(frozen=True, eq=False)
class RequestImages:
    items: tuple[ImageItem, ...]
    positions: np.ndarray  # [rows of all items] int64: the prompt positions of the image tokens
    ends: np.ndarray  # [items] int64: the cumulative rows of the items
    digest: bytes  # of every item's digest in order: the root of the request's prefix-cache chain

    @classmethod
    def of(cls, items: Sequence[ImageItem], positions: np.ndarray) -> RequestImages:
        digest = hashlib.sha256(b"".join(i.digest for i in items)).digest()
        ends = np.cumsum([i.num_rows for i in items])
        return cls(tuple(items), positions, ends, digest)

    def rows_for(self, start: int, end: int) -> ImageRows | None:
        """The image rows of the prompt's tokens [start, end), or None when they hold none."""
        lo, hi = (int(i) for i in np.searchsorted(self.positions, (start, end)))
        if lo == hi:
            return None
        first = int(np.searchsorted(self.ends, lo, side="right"))
        last = int(np.searchsorted(self.ends, hi - 1, side="right"))
        begin = 0 if first == 0 else int(self.ends[first - 1])
        offsets = (self.positions[lo:hi] - start).astype(np.int32)
        return ImageRows(self.items[first : last + 1], lo - begin, offsets)


def _image_digest(image, settings: str) -> bytes:
    h = hashlib.sha256(f"{image.mode} {image.size} {settings}".encode())
    h.update(image.tobytes())
    return h.digest()


class ImagePrompts:
    """A vision-language model's images into its prompts (Idefics3 / SmolVLM: each `<image>` in
    the prompt becomes its tiles' placeholder tokens, as transformers' Idefics3Processor writes
    them)."""

    def __init__(
        self, hf_config: Mapping, preprocessor_config: Mapping, overrides: Mapping | None, limit: int
    ):
        self.placeholder = image_placeholder(hf_config)
        self.config = Idefics3ImageConfig.from_preprocessor_config(preprocessor_config, overrides)
        vision = hf_config["vision_config"]
        side = vision["image_size"] // vision["patch_size"]
        self.rows_per_tile = side**2 // hf_config.get("scale_factor", 2) ** 2
        self.image_token_id = hf_config["image_token_id"]
        self.limit = limit
        self._settings = repr(self.config)

    @classmethod
    def for_model(cls, model_dir: str, hf_config: Mapping, overrides: Mapping | None, limits: Mapping):
        """The model's image prompts, or None for a model that takes no images."""
        if "vision_config" not in hf_config:
            return None
        path = os.path.join(model_dir, "preprocessor_config.json")
        try:
            with open(path, encoding="utf-8") as f:
                preprocessor = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(
                f"{path}: a vision-language model needs its image processor's config ({err})."
            ) from err
        return cls(hf_config, preprocessor, overrides, int(limits.get("image", DEFAULT_LIMIT)))

    def expand(
        self, token_ids: Sequence[int], images: Sequence, tokenizer
    ) -> tuple[list[int], RequestImages]:
        """The prompt's tokens with each placeholder token replaced by its image's tokens (the
        tokens of the text transformers' processor puts there: the placeholder and what replaces
        it are special tokens, so the text around them tokenizes the same either way), and where
        the images' rows go; ValueError when the images and the placeholders disagree or exceed
        the limit."""
        if len(images) > self.limit:
            raise ValueError(
                f"At most {self.limit} image(s) may be provided in one prompt (--limit-mm-per-prompt); got {len(images)}."
            )
        at = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise ValueError(
                f"The prompt has {len(at)} {self.placeholder} placeholder(s) for {len(images)} image(s): "
                f"put one {self.placeholder} where each image goes."
            )
        items, out, start = [], [], 0
        for image, where in zip(images, at, strict=True):
            processed = process_image(image, self.config)
            rows = processed.pixel_values.shape[0] * self.rows_per_tile
            items.append(ImageItem(_image_digest(image, self._settings), processed.pixel_values, rows))
            text = image_prompt(processed.rows, processed.cols, self.rows_per_tile)
            out += [*token_ids[start:where], *tokenizer.encode(text, add_special_tokens=False)]
            start = where + 1
        out += token_ids[start:]
        positions = np.flatnonzero(np.asarray(out) == self.image_token_id)
        if len(positions) != sum(i.num_rows for i in items):
            raise ValueError(
                f"The tokenizer does not keep {self.placeholder} whole: it is not one special token."
            )
        return out, RequestImages.of(items, positions)
