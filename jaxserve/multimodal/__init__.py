"""Images for vision-language models: their processors and the items a request carries (numpy and Pillow only)."""

from __future__ import annotations

from collections.abc import Mapping


def image_placeholder(hf_config: Mapping) -> str | None:
    """What stands for one image in a prompt's text (Idefics3 / SmolVLM's), or None for a model
    that takes no images."""
    return "<image>" if "vision_config" in hf_config else None
