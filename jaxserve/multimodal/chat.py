"""A chat conversation's images for the offline LLM.chat: image parts (OpenAI's `image_url`, and
vLLM's `image_pil` with a PIL image) become the `{"type": "image"}` parts chat templates show as
the model's placeholder, and their images are loaded (URLs as the server loads them)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping, Sequence

from jaxserve.multimodal.media import MediaLimits, load_image

IMAGE_PARTS = ("image_url", "image_pil")


def split_images(conversation: Sequence[Mapping]) -> tuple[list[dict], list]:
    """(the conversation with each image part as {"type": "image"}, each image's source in order:
    a PIL image or a URL)."""
    messages, sources = [], []
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, list) or not any(p.get("type") in IMAGE_PARTS for p in content):
            messages.append(dict(message))
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind == "image_pil":
                sources.append(part["image_pil"])
            elif kind == "image_url":
                value = part.get("image_url")
                sources.append(value.get("url") if isinstance(value, Mapping) else value)
            parts.append({"type": "image"} if kind in IMAGE_PARTS else part)
        messages.append({**message, "content": parts})
    return messages, sources


def load_images(sources: Sequence, limits: MediaLimits) -> list:
    """The images of split_images' sources, URLs loaded on a worker thread of its own (so this
    works whether or not the caller runs an event loop)."""
    urls = [s for s in sources if isinstance(s, str)]
    if not urls:
        return list(sources)

    async def load_all():
        return await asyncio.gather(*(load_image(u, limits) for u in urls))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loaded = iter(pool.submit(asyncio.run, load_all()).result())
    return [next(loaded) if isinstance(s, str) else s for s in sources]
