"""Image URLs of chat content parts (jaxserve.multimodal.media.load_image): data URLs,
file:// under --allowed-local-media-path, and http(s) from a local aiohttp server, each decoded
into the image that was encoded, and every bad URL a MediaError whose message says why."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import socket
import urllib.parse

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from PIL import Image

from jaxserve.multimodal.media import MediaError, MediaLimits, load_image

LIMITS = MediaLimits()


def _image(width: int = 7, height: int = 5) -> Image.Image:
    image = Image.new("RGB", (width, height))
    image.putdata(
        [((x * 37) % 256, (y * 53) % 256, (x * y * 11) % 256) for y in range(height) for x in range(width)]
    )
    return image


def _encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG = _encoded(_image())


async def _error(url: str, limits: MediaLimits = LIMITS, **kwargs) -> str:
    with pytest.raises(MediaError) as info:
        await load_image(url, limits, **kwargs)
    assert isinstance(info.value, ValueError)  # the app answers ValueErrors with a 400
    return str(info.value)


# data URLs


async def test_data_url_png_gives_the_same_pixels():
    image = await load_image(_data_url(PNG), LIMITS)
    assert image.format == "PNG"
    assert (image.size, image.mode) == ((7, 5), "RGB")
    assert image.tobytes() == _image().tobytes()


async def test_data_url_jpeg_decodes_to_its_size():
    image = await load_image(_data_url(_encoded(_image(16, 9), "JPEG"), "image/jpeg"), LIMITS)
    assert image.format == "JPEG"
    assert (image.size, image.mode) == ((16, 9), "RGB")


async def test_data_url_with_line_breaks_and_upper_case_header():
    payload = base64.encodebytes(_encoded(_image(40, 40))).decode()  # a line break every 76 characters
    assert "\n" in payload
    image = await load_image(f"data:IMAGE/PNG;BASE64,{payload}", LIMITS)
    assert image.tobytes() == _image(40, 40).tobytes()


async def test_invalid_base64():
    assert "invalid base64" in await _error("data:image/png;base64,iVBORw0KGgo*not-base64*")


async def test_data_url_of_another_media_type():
    message = await _error("data:text/plain;base64," + base64.b64encode(b"hello").decode())
    assert "'text/plain' is not an image" in message
    assert "not an image" in await _error("data:;base64,aGVsbG8=")


async def test_data_url_not_base64_or_without_a_comma():
    assert "must be base64-encoded" in await _error("data:image/png,rawbytes")
    assert "malformed data URL" in await _error("data:image/png;base64")


@pytest.mark.parametrize(
    "data",
    [b"this is not an image at all", PNG[:40], PNG[: len(PNG) // 2]],
    ids=["garbage", "header-only", "truncated"],
)
async def test_corrupt_image(data):
    assert "cannot decode image" in await _error(_data_url(data))


async def test_too_many_pixels_is_judged_before_decoding():
    limits = MediaLimits(max_pixels=34)
    assert "7x5 = 35 pixels, more than the limit of 34" in await _error(_data_url(PNG), limits)
    image = await load_image(_data_url(PNG), MediaLimits(max_pixels=35))
    assert image.size == (7, 5)


async def test_too_many_bytes():
    limits = MediaLimits(max_bytes=len(PNG) - 1)
    assert f"{len(PNG)} bytes, larger than the limit of {len(PNG) - 1} bytes" in await _error(
        _data_url(PNG), limits
    )
    big = _data_url(b"\0" * 4000)  # refused from the payload's length, before decoding
    assert "larger than the limit of 100 bytes" in await _error(big, MediaLimits(max_bytes=100))
    assert (await load_image(_data_url(PNG), MediaLimits(max_bytes=len(PNG)))).size == (7, 5)


async def test_pillow_decompression_bomb_is_too_large(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10)  # 35 pixels > 2 x 10: Pillow raises
    assert "too large to decode" in await _error(_data_url(PNG))


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
async def test_pillow_decompression_bomb_warning_is_too_large(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20)  # 20 < 35 pixels <= 40: Pillow warns
    assert "too large to decode" in await _error(_data_url(PNG))


async def test_eps_is_never_opened():
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    assert "not a supported image format" in await _error(_data_url(eps, "image/eps"))


# file:// URLs


@pytest.fixture
def media(tmp_path):
    """(allowed directory, a png outside it); the directory holds `my image.png`."""
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "my image.png").write_bytes(PNG)
    secret = tmp_path / "secret.png"
    secret.write_bytes(PNG)
    return allowed, secret


def _file_url(path) -> str:
    return "file://" + urllib.parse.quote(str(path))


async def test_file_url_under_the_allowed_directory(media):
    allowed, _ = media
    url = (allowed / "my image.png").as_uri()
    assert "%20" in url
    image = await load_image(url, MediaLimits(allowed_local_media_path=str(allowed)))
    assert image.tobytes() == _image().tobytes()
    localhost = "file://localhost" + urllib.parse.quote(str(allowed / "my image.png"))
    assert (await load_image(localhost, MediaLimits(allowed_local_media_path=str(allowed)))).size == (7, 5)


async def test_file_url_without_allowed_path(media):
    allowed, _ = media
    message = await _error((allowed / "my image.png").as_uri())
    assert "--allowed-local-media-path" in message
    assert "need" in message


async def test_file_url_outside_through_dot_dot(media):
    allowed, secret = media
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    url = _file_url(f"{allowed}/../{secret.name}")
    assert "outside the directory allowed by --allowed-local-media-path" in await _error(url, limits)


async def test_file_url_outside_through_a_symlink(media):
    allowed, secret = media
    (allowed / "link.png").symlink_to(secret)
    (allowed / "up").symlink_to(secret.parent)
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    for url in (_file_url(allowed / "link.png"), _file_url(allowed / "up" / secret.name)):
        assert "outside the directory allowed" in await _error(url, limits)


async def test_file_url_under_a_symlinked_allowed_directory(media, tmp_path):
    allowed, _ = media
    (tmp_path / "alias").symlink_to(allowed)
    limits = MediaLimits(allowed_local_media_path=str(tmp_path / "alias"))
    assert (await load_image(_file_url(tmp_path / "alias" / "my image.png"), limits)).size == (7, 5)
    assert (await load_image(_file_url(allowed / "my image.png"), limits)).size == (7, 5)


async def test_file_url_of_a_directory_whose_name_starts_like_the_allowed_one(media, tmp_path):
    allowed, _ = media
    sibling = tmp_path / "media-other"
    sibling.mkdir()
    (sibling / "a.png").write_bytes(PNG)
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    assert "outside the directory allowed" in await _error(_file_url(sibling / "a.png"), limits)


async def test_missing_file_directory_and_relative_path(media):
    allowed, _ = media
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    assert "no such file" in await _error(_file_url(allowed / "absent.png"), limits)
    assert "not a regular file" in await _error(_file_url(allowed), limits)
    assert "not an absolute path" in await _error("file:my%20image.png", limits)
    assert "host 'example.com' is not supported" in await _error("file://example.com/x.png", limits)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
async def test_fifo_does_not_hang(media):
    allowed, _ = media
    os.mkfifo(allowed / "pipe.png")
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    message = await asyncio.wait_for(_error(_file_url(allowed / "pipe.png"), limits), 5)
    assert "not a regular file" in message


async def test_file_too_many_bytes(media):
    allowed, _ = media
    limits = MediaLimits(allowed_local_media_path=str(allowed), max_bytes=len(PNG) - 1)
    message = await _error(_file_url(allowed / "my image.png"), limits)
    assert f"{len(PNG)} bytes, larger than the limit of {len(PNG) - 1} bytes" in message


# http(s) URLs


@pytest.fixture
async def http_server():
    async def png(request: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def missing(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    async def sized(request: web.Request) -> web.Response:  # with a Content-Length
        return web.Response(body=b"\0" * 2000, content_type="image/png")

    async def streamed(request: web.Request) -> web.StreamResponse:  # chunked, no Content-Length
        response = web.StreamResponse()
        response.content_type = "image/png"
        await response.prepare(request)
        for _ in range(8):
            await response.write(b"\0" * 512)
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    async def slow_headers(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(body=PNG, content_type="image/png")

    async def slow_body(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_type = "image/png"
        await response.prepare(request)
        for byte in PNG:
            await response.write(bytes([byte]))
            await asyncio.sleep(0.05)
        return response

    app = web.Application()
    for path, handler in [("/img.png", png), ("/missing", missing), ("/sized", sized), ("/streamed", streamed),
                          ("/slow-headers", slow_headers), ("/slow-body", slow_body)]:  # fmt: skip
        app.router.add_get(path, handler)
    server = TestServer(app, host="127.0.0.1", handler_cancellation=True)
    await server.start_server()
    yield server
    await server.close()


async def test_http_fetch_with_a_temporary_session(http_server):
    image = await load_image(str(http_server.make_url("/img.png")), LIMITS)
    assert image.tobytes() == _image().tobytes()


async def test_http_passed_session_stays_open(http_server):
    async with ClientSession() as session:
        image = await load_image(str(http_server.make_url("/img.png")), LIMITS, session)
        assert image.tobytes() == _image().tobytes()
        assert not session.closed
        assert "HTTP 404" in await _error(str(http_server.make_url("/missing")), session=session)
        assert not session.closed


async def test_http_error_status(http_server):
    message = await _error(str(http_server.make_url("/missing")))
    assert "failed: HTTP 404 Not Found" in message
    assert "/missing" in message


@pytest.mark.parametrize("path", ["/sized", "/streamed"])
async def test_http_body_too_large(http_server, path):
    message = await _error(str(http_server.make_url(path)), MediaLimits(max_bytes=1000))
    assert "larger than the limit of 1000 bytes" in message
    if path == "/sized":  # refused from its Content-Length, before the body is read
        assert "2000 bytes" in message


@pytest.mark.parametrize("path", ["/slow-headers", "/slow-body"])
async def test_http_timeout(http_server, path):
    loop = asyncio.get_running_loop()
    start = loop.time()
    message = await _error(str(http_server.make_url(path)), MediaLimits(fetch_timeout_s=0.3))
    assert "timed out after 0.3 s" in message
    assert loop.time() - start < 2


async def test_http_connection_refused():
    with socket.socket() as sock:  # bound, never listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        message = await _error(f"http://127.0.0.1:{port}/img.png")
    assert "cannot fetch image from http://127.0.0.1" in message
    assert "ClientConnectorError" in message


# other schemes


async def test_unsupported_scheme():
    message = await _error("ftp://example.com/cat.png")
    assert "unsupported image URL scheme 'ftp'" in message
    for scheme in ("http://", "https://", "data:image/", "file://"):
        assert scheme in message
    assert "has no scheme" in await _error("/etc/passwd")
    assert "non-empty string" in await _error("")
