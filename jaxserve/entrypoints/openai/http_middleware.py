"""The server's own middlewares: every failure as an OpenAI-style error body, the API key on
/v1 routes, and CORS. build_app (api_server.py) installs them around the routes; user
middlewares (--middleware, user_middleware.py) run inside them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from jaxserve.engine.async_engine import EngineRequestError
from jaxserve.entrypoints.openai.protocol import error_body
from jaxserve.entrypoints.openai.server_args import ServerArgs
from jaxserve.entrypoints.openai.serving_engine import ModelNotFound

logger = logging.getLogger("jaxserve.entrypoints.openai.api_server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(message: str, status: int = 400, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status, param), status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI-style JSON error; a bug is a 500, never a crash."""
    try:
        return await handler(request)
    except ValueError as e:
        return error_response(str(e), getattr(e, "status", 400), getattr(e, "param", None))
    except ModelNotFound as e:
        return error_response(str(e), 404, "model")
    except web.HTTPRequestEntityTooLarge:
        limit = request.app._client_max_size
        return error_response(f"The request body is too large (the limit is {limit} bytes).", 413)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.reason or e.text or "error", e.status)
    except EngineRequestError as e:
        return error_response(str(e), 500)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # the trace goes to the log; the client learns nothing of the internals
        logger.exception("Unhandled error in %s %s", request.method, request.path)
        return error_response("Internal server error (the server log has the details).", 500)


def auth_middleware(api_key: str, root_path: str) -> Callable:
    expected = f"Bearer {api_key}"
    prefixes = ("/v1", root_path.rstrip("/") + "/v1") if root_path else ("/v1",)

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "OPTIONS" and request.path.startswith(prefixes):
            if request.headers.get("Authorization") != expected:
                return error_response(
                    "Unauthorized: a valid API key is required (Authorization: Bearer).", 401
                )
        return await handler(request)

    return auth


def cors_middleware(args: ServerArgs) -> Callable:
    """CORS like Starlette's CORSMiddleware, which vLLM uses: preflights are answered
    here, other responses get the allow-origin headers."""
    any_origin = "*" in args.allowed_origins
    methods = (
        "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
        if "*" in args.allowed_methods
        else ", ".join(args.allowed_methods)
    )

    def allow_origin(origin: str) -> str | None:
        if any_origin:
            return origin if args.allow_credentials else "*"
        return origin if origin in args.allowed_origins else None

    @web.middleware
    async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is None:
            return await handler(request)
        allowed = allow_origin(origin)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            wanted = request.headers["Access-Control-Request-Method"]
            if allowed is None or ("*" not in args.allowed_methods and wanted not in args.allowed_methods):
                return web.Response(status=400, text="Disallowed CORS request")
            requested_headers = request.headers.get("Access-Control-Request-Headers", "")
            headers = {
                "Access-Control-Allow-Origin": allowed,
                "Access-Control-Allow-Methods": methods,
                "Access-Control-Allow-Headers": requested_headers
                if "*" in args.allowed_headers
                else ", ".join(args.allowed_headers),
                "Access-Control-Max-Age": "600",
                "Vary": "Origin",
            }
            if args.allow_credentials:
                headers["Access-Control-Allow-Credentials"] = "true"
            return web.Response(status=200, headers=headers)
        response = await handler(request)
        if allowed is not None and not response.prepared:
            response.headers["Access-Control-Allow-Origin"] = allowed
            if args.allow_credentials:
                response.headers["Access-Control-Allow-Credentials"] = "true"
            if not any_origin or args.allow_credentials:
                response.headers["Vary"] = "Origin"
        return response

    return cors
