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

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxserve.multimodal import image_placeholder, qwen2_5_vl_windows, vision_positions
from jaxserve.multimodal import qwen2_vl_processor as qwen2_vl
from jaxserve.multimodal.idefics3_processor import Idefics3ImageConfig, image_prompt, process_image

# vLLM's default: this many items of a modality per prompt unless --limit-mm-per-prompt says less
DEFAULT_LIMIT = 999


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image as the encoder takes it: the model's `image_call` once per entry of `calls`
    (Idefics3: a tile each; Qwen2-VL: the image's patches, padded to a bucket), its rows the first
    `num_rows` of their outputs, concatenated."""

    digest: bytes  # sha256 of the image's mode, size and pixels and the processor's settings
    calls: tuple[tuple[np.ndarray, ...], ...]
    num_rows: int


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
    # M-RoPE models: the prompt's [3, prompt length] (time, height, width) positions, and how far
    # the positions after the prompt run ahead of the sequence's (transformers' rope delta)
    rope: np.ndarray | None = None
    rope_delta: int = 0

    @classmethod
    def of(
        cls,
        items: Sequence[ImageItem],
        positions: np.ndarray,
        rope: np.ndarray | None = None,
        rope_delta: int = 0,
    ) -> RequestImages:
        digest = hashlib.sha256(b"".join(i.digest for i in items)).digest()
        ends = np.cumsum([i.num_rows for i in items])
        return cls(tuple(items), positions, ends, digest, rope, rope_delta)

    def rope_for(self, start: int, end: int) -> np.ndarray:
        """[3, end - start] int32 M-RoPE positions of the tokens [start, end): the prompt's own,
        then each later token's sequence position plus the delta, three times."""
        out = np.empty((3, end - start), np.int32)
        known = max(0, min(end, self.rope.shape[1]) - start)
        out[:, :known] = self.rope[:, start : start + known]
        out[:, known:] = np.arange(start + known, end) + self.rope_delta
        return out

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
    """A vision-language model's images into its prompts: each image's placeholder token in the
    prompt becomes the image's tokens, as the model's transformers processor writes them (the
    families below say how)."""

    def __init__(self, hf_config: Mapping, limit: int):
        self.placeholder = image_placeholder(hf_config)
        self.image_token_id = hf_config["image_token_id"]
        self.limit = limit

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
        items, grids, out, start = [], [], [], 0
        for image, where in zip(images, at, strict=True):
            item, tokens, grid = self._image(image, tokenizer)
            items.append(item)
            grids.append(grid)
            out += [*token_ids[start:where], *tokens]
            start = where + 1
        out += token_ids[start:]
        positions = np.flatnonzero(np.asarray(out) == self.image_token_id)
        if len(positions) != sum(i.num_rows for i in items):
            raise ValueError(
                f"The tokenizer does not keep {self.placeholder} whole: it is not one special token."
            )
        return out, RequestImages.of(items, positions, *self._rope(out, grids))

    def _image(self, image, tokenizer) -> tuple[ImageItem, list[int], object]:
        """(the image processed, the tokens that stand for it, what _rope needs of it)."""
        raise NotImplementedError

    def _rope(self, token_ids: list[int], grids: list) -> tuple[np.ndarray | None, int]:
        """M-RoPE positions of the prompt and their delta; (None, 0) for a one-position rope."""
        return None, 0


class Idefics3Prompts(ImagePrompts):
    """Idefics3 / SmolVLM: `<image>` becomes the image's tiles, each `<image>` x rows-per-tile
    between its row/column tags, and the global image last (Idefics3Processor's text)."""

    def __init__(
        self, hf_config: Mapping, preprocessor_config: Mapping, overrides: Mapping | None, limit: int
    ):
        super().__init__(hf_config, limit)
        self.config = Idefics3ImageConfig.from_preprocessor_config(preprocessor_config, overrides)
        vision = hf_config["vision_config"]
        side = vision["image_size"] // vision["patch_size"]
        self.rows_per_tile = side**2 // hf_config.get("scale_factor", 2) ** 2
        self._settings = repr(self.config)

    def _image(self, image, tokenizer):
        processed = process_image(image, self.config)
        tiles = processed.pixel_values
        item = ImageItem(
            _image_digest(image, self._settings), tuple((t,) for t in tiles), len(tiles) * self.rows_per_tile
        )
        text = image_prompt(processed.rows, processed.cols, self.rows_per_tile)
        return item, tokenizer.encode(text, add_special_tokens=False), None


class Qwen2VLPrompts(ImagePrompts):
    """Qwen2-VL: the chat template's `<|vision_start|><|image_pad|><|vision_end|>` keeps its
    start and end, and `<|image_pad|>` becomes one per 2x2 block of the image's patches; the
    prompt's M-RoPE positions follow the images' grids (transformers' get_rope_index)."""

    def __init__(
        self, hf_config: Mapping, preprocessor_config: Mapping, overrides: Mapping | None, limit: int
    ):
        super().__init__(hf_config, limit)
        self.config = qwen2_vl.Qwen2VLImageConfig.from_preprocessor_config(preprocessor_config, overrides)
        self.vision_start_token_id = hf_config["vision_start_token_id"]
        self._settings = repr(self.config)

    def _image(self, image, tokenizer):
        processed = qwen2_vl.process_image(image, self.config)
        n, merge = processed.pixel_values.shape[0], self.config.merge_size
        bucket = max(64, 1 << (n - 1).bit_length())  # (the encoder's compiled sizes)
        patches = np.zeros((bucket, processed.pixel_values.shape[1]), np.float32)
        patches[:n] = processed.pixel_values
        where = np.zeros((bucket, 2), np.int32)
        where[:n] = vision_positions(processed.grid_thw[1:], merge)
        rows = qwen2_vl.image_token_count(processed.grid_thw, merge)
        item = ImageItem(_image_digest(image, self._settings), ((patches, where, np.int32(n)),), rows)
        return item, [self.image_token_id] * rows, processed.grid_thw

    def _rope(self, token_ids: list[int], grids: list) -> tuple[np.ndarray | None, int]:
        positions, delta = qwen2_vl.mrope_positions(
            token_ids, grids, self.image_token_id, self.vision_start_token_id, self.config.merge_size
        )
        return positions.astype(np.int32), delta


class Qwen2_5_VLPrompts(Qwen2VLPrompts):
    """Qwen2.5-VL: Qwen2-VL's prompts, its images' calls also carrying the encoder's window order
    and each merged unit's window (multimodal/qwen2_5_vl_windows.py), padded to the patches'
    bucket."""

    def __init__(
        self, hf_config: Mapping, preprocessor_config: Mapping, overrides: Mapping | None, limit: int
    ):
        super().__init__(hf_config, preprocessor_config, overrides, limit)
        self.window = qwen2_5_vl_windows.merger_window(hf_config["vision_config"])
        self._settings += f" window={self.window}"

    def _image(self, image, tokenizer):
        item, tokens, grid = super()._image(image, tokenizer)
        ((patches, where, n),) = item.calls
        merge = self.config.merge_size
        index, ids = qwen2_5_vl_windows.window_inputs(
            grid[1:], merge, self.window, patches.shape[0] // merge**2
        )
        return dataclasses.replace(item, calls=((patches, where, n, index, ids),)), tokens, grid


_FAMILIES = {
    "Idefics3ForConditionalGeneration": Idefics3Prompts,
    "Qwen2VLForConditionalGeneration": Qwen2VLPrompts,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLPrompts,
}


def image_prompts_for(
    model_dir: str, hf_config: Mapping, overrides: Mapping | None, limits: Mapping
) -> ImagePrompts | None:
    """The model's image prompts, or None for a model that takes no images."""
    family = next((_FAMILIES[a] for a in hf_config.get("architectures") or () if a in _FAMILIES), None)
    if family is None:
        return None
    path = os.path.join(model_dir, "preprocessor_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            preprocessor = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{path}: a vision-language model needs its image processor's config ({err})."
        ) from err
    return family(hf_config, preprocessor, overrides, int(limits.get("image", DEFAULT_LIMIT)))
