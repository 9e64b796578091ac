"""Middlewares for --middleware tests, written as vLLM's docs write them: async (request, call_next)."""

from aiohttp import web

SEEN: list[tuple[str, int]] = []


async def stamp(request, call_next):
    """Every response carries X-Stamped, errors included; the (path, status) pairs are kept."""
    response = await call_next(request)
    response.headers["X-Stamped"] = "yes"
    SEEN.append((request.path, response.status))
    return response


async def gate(request, call_next):
    """Requests without X-Ticket never reach the server."""
    if "X-Ticket" not in request.headers:
        return web.json_response({"error": {"message": "no ticket"}}, status=403)
    return await call_next(request)


class AsgiStyle:
    def __init__(self, app):
        self.app = app


def not_async(request, call_next):
    return call_next(request)
