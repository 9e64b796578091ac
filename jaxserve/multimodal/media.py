"""Images named by the `url` of an OpenAI chat content part
(`{"type": "image_url", "image_url": {"url": ...}}`), fetched and decoded into PIL images, as
vLLM does.

Supported URLs: `data:image/<format>;base64,<data>`, `http://` and `https://` (fetched with
aiohttp under a time limit, the body refused once it passes the byte limit), and `file://`
under the directory named by --allowed-local-media-path (refused when that is unset). Every
client mistake is a MediaError (a ValueError, so the app answers it with a 400) whose message
says what is wrong. File reads, base64 decoding and image decoding run in worker threads, so a
large image never blocks the event loop.

Where it sits: called by the chat prompt code for each image content part; the caller turns
the image into what the model's processor takes (mode conversion, resizing).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import stat
import urllib.parse
from dataclasses import dataclass

import aiohttp
from PIL import Image, UnidentifiedImageError

SUPPORTED_SCHEMES = "http://, https://, data:image/<format>;base64,... and file://"

# Pillow formats never opened: EPS is rendered by running Ghostscript on the client's bytes.
_REFUSED_FORMATS = frozenset({"EPS"})

_CHUNK_BYTES = 1 << 16


class MediaError(ValueError):
    """An image URL that cannot be turned into an image; the message is the client's 400 body."""


@dataclass(frozen=True)
class MediaLimits:
    # file:// URLs are served only from under this directory ("" refuses them), vLLM's
    # --allowed-local-media-path
    allowed_local_media_path: str = ""
    # an encoded image (decoded base64, file contents, HTTP body) larger than this is refused
    max_bytes: int = 20 * 2**20
    # a decoded image with more pixels is refused, judged from its header before decoding
    max_pixels: int = 4096 * 4096
    # the time limit of an http(s) fetch, connecting through reading the whole body
    fetch_timeout_s: float = 10.0


def _shorten(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _too_many_bytes(limits: MediaLimits, size: int | None = None) -> MediaError:
    if size is None:
        return MediaError(f"image is larger than the limit of {limits.max_bytes} bytes")
    return MediaError(f"image is {size} bytes, larger than the limit of {limits.max_bytes} bytes")


async def load_image(
    url: str, limits: MediaLimits, session: aiohttp.ClientSession | None = None
) -> Image.Image:
    """The image `url` names, decoded (not yet converted to any mode). `session` fetches
    http(s) URLs; without one a temporary session is made for the fetch."""
    if not isinstance(url, str) or not url:
        raise MediaError("image URL must be a non-empty string")
    scheme, sep, _ = url.partition(":")
    scheme = scheme.lower() if sep else ""
    if scheme == "data":
        data = await asyncio.to_thread(_data_url_bytes, url, limits)
    elif scheme in ("http", "https"):
        data = await _fetch(url, limits, session)
    elif scheme == "file":
        data = await asyncio.to_thread(_read_file, url, limits)
    elif not scheme:
        raise MediaError(f"image URL {_shorten(url)!r} has no scheme; supported: {SUPPORTED_SCHEMES}")
    else:
        raise MediaError(
            f"unsupported image URL scheme {_shorten(scheme, 20)!r}; supported: {SUPPORTED_SCHEMES}"
        )
    return await asyncio.to_thread(_decode, data, limits)


def _data_url_bytes(url: str, limits: MediaLimits) -> bytes:
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise MediaError("malformed data URL: expected data:image/<format>;base64,<data>")
    media_type, *params = (p.strip() for p in header.split(";"))
    media_type = media_type.lower()
    if not media_type.startswith("image/"):
        shown = _shorten(media_type, 60) or "text/plain"
        raise MediaError(
            f"data URL media type {shown!r} is not an image; expected data:image/<format>;base64,<data>"
        )
    if not any(p.lower() == "base64" for p in params):
        raise MediaError("image data URLs must be base64-encoded: data:image/<format>;base64,<data>")
    # refused before spending time decoding it (the slack is for line breaks in the payload)
    if len(payload) // 4 * 3 > limits.max_bytes + limits.max_bytes // 16 + 3:
        raise _too_many_bytes(limits)
    payload = "".join(payload.split())  # line breaks some encoders insert
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"invalid base64 in image data URL: {e}") from None
    if len(data) > limits.max_bytes:
        raise _too_many_bytes(limits, len(data))
    return data


def _read_file(url: str, limits: MediaLimits) -> bytes:
    if not limits.allowed_local_media_path:
        raise MediaError("file:// image URLs need the server to be started with --allowed-local-media-path")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(
            f"file URL host {_shorten(parts.netloc, 60)!r} is not supported; use file:///absolute/path"
        )
    path = urllib.parse.unquote(parts.path)
    shown = _shorten(path, 200)
    if not os.path.isabs(path) or "\x00" in path:
        raise MediaError(f"file URL path {shown!r} is not an absolute path")
    # both real paths, so neither `..` nor a symlink inside the directory leads out of it
    root = os.path.realpath(limits.allowed_local_media_path)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise MediaError(
            f"file path {shown!r} is outside the directory allowed by --allowed-local-media-path"
        )
    try:
        # non-blocking, so that a FIFO in the directory cannot hang the thread in open()
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise MediaError(f"no such file: {shown!r}") from None
    except OSError as e:
        raise MediaError(f"cannot read file {shown!r}: {e.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise MediaError(f"{shown!r} is not a regular file")
    with open(fd, "rb") as f:
        if info.st_size > limits.max_bytes:
            raise _too_many_bytes(limits, info.st_size)
        try:
            data = f.read(limits.max_bytes + 1)
        except OSError as e:
            raise MediaError(f"cannot read file {shown!r}: {e.strerror}") from None
    if len(data) > limits.max_bytes:  # the file grew after the fstat
        raise _too_many_bytes(limits)
    return data


async def _fetch(url: str, limits: MediaLimits, session: aiohttp.ClientSession | None) -> bytes:
    own = session is None
    if own:
        session = aiohttp.ClientSession(trust_env=True)
    try:
        return await asyncio.wait_for(_fetch_body(url, limits, session), limits.fetch_timeout_s)
    except asyncio.TimeoutError:
        raise MediaError(
            f"fetching image from {_shorten(url)} timed out after {limits.fetch_timeout_s:g} s"
        ) from None
    except aiohttp.ClientError as e:
        raise MediaError(f"cannot fetch image from {_shorten(url)}: {type(e).__name__}: {e}") from None
    finally:
        if own:
            await session.close()


async def _fetch_body(url: str, limits: MediaLimits, session: aiohttp.ClientSession) -> bytes:
    async with session.get(url) as response:
        if not 200 <= response.status < 300:
            raise MediaError(
                f"fetching image from {_shorten(url)} failed: HTTP {response.status} {response.reason or ''}".rstrip()
            )
        if response.content_length is not None and response.content_length > limits.max_bytes:
            raise _too_many_bytes(limits, response.content_length)
        body = bytearray()
        async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
            body += chunk
            if len(body) > limits.max_bytes:
                raise _too_many_bytes(limits)
        return bytes(body)


def _decode(data: bytes, limits: MediaLimits) -> Image.Image:
    Image.init()
    formats = [f for f in Image.OPEN if f not in _REFUSED_FORMATS]
    try:
        image = Image.open(io.BytesIO(data), formats=formats)
        width, height = image.size
        if width * height > limits.max_pixels:
            image.close()
            raise MediaError(
                f"image is {width}x{height} = {width * height} pixels, more than the limit of {limits.max_pixels}"
            )
        image.load()
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise MediaError(f"image is too large to decode: {e}") from None
    except UnidentifiedImageError:
        raise MediaError("cannot decode image: not a supported image format") from None
    except Exception as e:
        raise MediaError(f"cannot decode image: {e}") from None
    return image
