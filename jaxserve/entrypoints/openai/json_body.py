"""A request's JSON body, refused before anything reads it unless it is safe to hand on.

Where it sits: the first thing every POST route of api_server does, before pydantic,
the tokenizer or the engine see the body. Three refusals, each an OpenAI-style 4xx:
- a body not declared JSON (415): browsers send text/plain and form posts cross-site without a
  CORS preflight, so parsing those would let any web page drive a local server;
- nesting deeper than MAX_DEPTH (400): deep nesting exhausts the parser's or a validator's stack;
- a string that is not Unicode text, i.e. holds a lone surrogate that JSON's \\ud800 escapes can
  make (400 naming the field): no tokenizer can encode it.
"""

from __future__ import annotations

import json

from aiohttp import web

from jaxserve.entrypoints.openai.protocol import bad_request

# Deeper than any request the API defines (a JSON schema in a tool or response_format nests a
# few dozen levels at most), far below what exhausts a stack.
MAX_DEPTH = 64


def is_json_content_type(content_type: str) -> bool:
    return content_type == "application/json" or (
        content_type.startswith("application/") and content_type.endswith("+json")
    )


async def read_json_object(request: web.Request) -> dict:
    if not is_json_content_type(request.content_type):
        err = bad_request(
            f"Unsupported Content-Type {request.content_type!r}: send the body as application/json."
        )
        err.status = 415  # the middleware answers a ValueError with its status, else 400
        raise err
    raw = await request.read()
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("The request body is not valid UTF-8 JSON.") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request(f"The request body nests deeper than {MAX_DEPTH} levels.") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    check_json_value(data)
    return data


def check_json_value(data: dict | list) -> None:
    """Depth and text checks over a parsed body, without recursion (a deep body is the attack)."""
    stack: list[tuple[object, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(
                f"The request body nests deeper than {MAX_DEPTH} levels (at {path or 'the top'})."
            )
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            where = (f"{path}.{key}" if path else str(key)) if isinstance(key, str) else f"{path}[{key}]"
            if isinstance(key, str):
                _check_text(key, where)
            if isinstance(item, str):
                _check_text(item, where)
            elif isinstance(item, (dict, list)):
                stack.append((item, where, depth + 1))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"{where}: the string is not valid Unicode (a lone surrogate such as \\ud800).",
            param=where.split(".")[0].split("[")[0],
        ) from None
