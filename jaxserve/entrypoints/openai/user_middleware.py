"""--middleware: the user's own aiohttp middlewares, by import path, as vLLM takes them.

vLLM adds a function given to --middleware as HTTP middleware: `async def m(request, call_next)`,
returning `await call_next(request)` or a response of its own. The same function, written for
aiohttp's request and response objects, is an aiohttp middleware (its handler is call_next).
vLLM's other kind, an ASGI middleware class, has no meaning for an aiohttp server and is refused.
They run inside CORS and the API-key check, and outside the error handling, so they see every
response the server sends, errors as JSON responses included."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

from aiohttp import web


def load_middleware(path: str) -> Callable:
    """The middleware at `path` ("package.module.name"); ValueError, one line, if it is not one."""
    module, _, name = path.rpartition(".")
    if not module or not name:
        raise ValueError(f"--middleware {path!r} is not an import path (module.name).")
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--middleware {path!r} cannot be imported: {e}") from None
    if inspect.isclass(value):
        raise ValueError(
            f"--middleware {path!r} is a class (an ASGI middleware); jaxserve's server is aiohttp: "
            "give an async function (request, handler) that returns a response."
        )
    if not inspect.iscoroutinefunction(value) or len(inspect.signature(value).parameters) != 2:
        raise ValueError(f"--middleware {path!r} must be an async function (request, handler).")

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        return await value(request, handler)  # (aiohttp passes `handler=` by name; theirs may differ)

    return middleware
