"""--middleware: the user's async (request, call_next) functions, by import path, wrap every
request inside CORS and the API-key check and see every response, errors as JSON included; an
import path that is not such a function stops `jaxserve serve` with one line."""

from __future__ import annotations

import pytest
import sample_middleware
from aiohttp import ClientSession
from server_inputs import MODEL

from jaxserve.cli import main

BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


async def test_middlewares_wrap_every_response_in_order(make_server):
    sample_middleware.SEEN.clear()
    server = await make_server(middleware=["sample_middleware.gate", "sample_middleware.stamp"], api_key="k")
    url = str(server.make_url("/"))
    auth = {"Authorization": "Bearer k"}
    async with ClientSession() as http:
        async with http.post(url + "v1/completions", json=BODY, headers=auth) as r:
            assert r.status == 403 and "X-Stamped" not in r.headers  # the gate answered
        ticket = {**auth, "X-Ticket": "1"}
        async with http.post(url + "v1/completions", json=BODY, headers=ticket) as r:
            assert r.status == 200 and r.headers["X-Stamped"] == "yes"
            assert (await r.json())["object"] == "text_completion"
        async with http.post(url + "v1/completions", json={**BODY, "max_tokens": -1}, headers=ticket) as r:
            assert r.status == 400 and r.headers["X-Stamped"] == "yes"  # an error, as JSON
            assert (await r.json())["error"]["type"] == "BadRequestError"
        async with http.post(url + "v1/completions", json=BODY, headers={"X-Ticket": "1"}) as r:
            assert r.status == 401  # the API key is checked before the user's middlewares
    assert sample_middleware.SEEN == [("/v1/completions", 200), ("/v1/completions", 400)]


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_module.mw", "cannot be imported"),
        ("sample_middleware.missing", "cannot be imported"),
        ("stamp", "is not an import path"),
        ("sample_middleware.AsgiStyle", "is a class (an ASGI middleware)"),
        ("sample_middleware.not_async", "must be an async function (request, handler)"),
    ],
)
def test_what_is_not_a_middleware_stops_the_server_in_one_line(path, message, capsys, monkeypatch):
    built = []
    monkeypatch.setattr("jaxserve.entrypoints.openai.api_server.run_server", lambda *a: built.append(a))
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--middleware", path])
    assert exc.value.code == 2 and built == []
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and path in lines[0], lines
