"""Front-end flags: API key, CORS, TLS, root path, request-id headers, OpenAPI document,
load tracking, chat templates and the response role."""

from __future__ import annotations

import logging
import ssl

import pytest
from aiohttp import ClientSession
from server_inputs import MODEL

CHAT = {"messages": [{"role": "user", "content": "Paris is"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture
async def session():
    async with ClientSession() as s:
        yield s


async def test_api_key_guards_v1_only(make_server, session):
    server = await make_server(api_key="sekret")
    url = str(server.make_url("/"))
    async with session.get(url + "v1/models") as r:
        assert r.status == 401
        assert (await r.json())["error"]["code"] == 401
    async with session.get(url + "v1/models", headers={"Authorization": "Bearer wrong"}) as r:
        assert r.status == 401
    async with session.get(url + "v1/models", headers={"Authorization": "Bearer sekret"}) as r:
        assert r.status == 200
    async with session.post(url + "v1/completions", json={"prompt": "a", "max_tokens": 1}) as r:
        assert r.status == 401
    async with session.get(url + "health") as r:
        assert r.status == 200
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=url + "v1", api_key="sekret", max_retries=0)
    assert (await client.models.list()).data[0].id == MODEL
    await client.close()


async def test_cors_preflight_and_simple_requests(make_server, session):
    server = await make_server(allowed_origins=["https://ui.example"], allow_credentials=True)
    url = str(server.make_url("/"))
    preflight = {
        "Origin": "https://ui.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    async with session.options(url + "v1/chat/completions", headers=preflight) as r:
        assert r.status == 200
        assert r.headers["Access-Control-Allow-Origin"] == "https://ui.example"
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert r.headers["Access-Control-Allow-Credentials"] == "true"
    async with session.options(
        url + "v1/chat/completions", headers={**preflight, "Origin": "https://evil"}
    ) as r:
        assert r.status == 400
        assert "Access-Control-Allow-Origin" not in r.headers
    async with session.get(url + "v1/models", headers={"Origin": "https://ui.example"}) as r:
        assert r.headers["Access-Control-Allow-Origin"] == "https://ui.example"
    async with session.get(url + "v1/models", headers={"Origin": "https://evil"}) as r:
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers


async def test_cors_defaults_allow_any_origin(server, session):
    url = str(server.make_url("/"))
    headers = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
    async with session.options(url + "v1/completions", headers=headers) as r:
        assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"


async def test_tls_with_a_self_signed_certificate(make_server, tmp_path, session):
    trustme = pytest.importorskip("trustme")
    from jaxserve.entrypoints.openai.server_args import ServerArgs
    from jaxserve.entrypoints.openai.tls import ssl_context

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    key_file, cert_file = tmp_path / "key.pem", tmp_path / "cert.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    args = ServerArgs(ssl_keyfile=str(key_file), ssl_certfile=str(cert_file))
    server = await make_server(ssl=ssl_context(args), ssl_keyfile=str(key_file), ssl_certfile=str(cert_file))
    url = str(server.make_url("/"))
    assert url.startswith("https://")
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with session.post(url + "v1/chat/completions", json=CHAT, ssl=client_ctx) as r:
        assert r.status == 200 and (await r.json())["object"] == "chat.completion"
    with pytest.raises(Exception, match="(?i)certificate"):  # an untrusting client refuses it
        async with session.get(url + "health", ssl=ssl.create_default_context()):
            pass

    # --ssl-ca-certs with --ssl-cert-reqs 2 (CERT_REQUIRED): only clients with a certificate
    # signed by that CA get in.
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    strict = ServerArgs(
        ssl_keyfile=str(key_file), ssl_certfile=str(cert_file), ssl_ca_certs=str(ca_file), ssl_cert_reqs=2
    )
    server = await make_server(ssl=ssl_context(strict))
    url = str(server.make_url("/"))
    with pytest.raises(Exception):  # noqa: B017 - the handshake fails with a version-dependent error
        async with session.get(url + "health", ssl=client_ctx) as r:
            await r.read()
    ca.issue_cert("client@example").configure_cert(client_ctx)
    async with session.get(url + "health", ssl=client_ctx) as r:
        assert r.status == 200


async def test_root_path_request_ids_load_and_docs(make_server, session):
    server = await make_server(
        root_path="/llm", enable_request_id_headers=True, enable_server_load_tracking=True
    )
    url = str(server.make_url("/"))
    async with session.post(url + "llm/v1/completions", json={"prompt": "a", "max_tokens": 1}) as r:
        assert r.status == 200 and r.headers["X-Request-Id"]
    async with session.post(url + "v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-123"}) as r:
        assert r.headers["X-Request-Id"] == "abc-123"
        assert (await r.json())["id"] == "chatcmpl-abc-123"
    async with session.post(
        url + "v1/completions",
        json={"prompt": "a", "max_tokens": 2, "stream": True},
        headers={"X-Request-Id": "s1"},
    ) as r:
        assert r.headers["X-Request-Id"] == "s1"
        assert '"id": "cmpl-s1"' in await r.text()
    async with session.get(url + "load") as r:
        assert (await r.json()) == {"server_load": 0}
    async with session.get(url + "openapi.json") as r:
        doc = await r.json()
    assert doc["servers"] == [{"url": "/llm"}]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= set(doc["paths"])
    schema = doc["components"]["schemas"]["CompletionRequest"]
    assert {"prompt", "max_tokens", "top_k", "min_p", "ignore_eos"} <= set(schema["properties"])
    docs_off = await make_server(disable_fastapi_docs=True)
    async with session.get(str(docs_off.make_url("/openapi.json"))) as r:
        assert r.status == 404
    async with session.get(str(docs_off.make_url("/load"))) as r:
        assert r.status == 404  # load tracking is off by default


async def test_chat_template_flag_content_format_and_role(make_server, session, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    server = await make_server(chat_template=str(template), response_role="bot")
    url = str(server.make_url("/"))
    parts = [{"type": "text", "text": "Paris"}, {"type": "text", "text": "is"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2, "temperature": 0}
    async with session.post(
        url + "tokenize", json={"messages": body["messages"], "add_special_tokens": False}
    ) as r:
        tokens = (await r.json())["tokens"]
    async with session.post(url + "detokenize", json={"tokens": tokens}) as r:
        assert (await r.json())["prompt"] == "[user] Paris\nis\n"  # string format: parts joined
    async with session.post(url + "v1/chat/completions", json=body) as r:
        out = await r.json()
    assert out["choices"][0]["message"]["role"] == "bot"
    echo = {**body, "messages": [*body["messages"], {"role": "bot", "content": "So"}],
            "add_generation_prompt": False, "continue_final_message": True, "echo": True}  # fmt: skip
    async with session.post(url + "v1/chat/completions", json=echo) as r:
        out = await r.json()
    assert out["choices"][0]["message"]["content"].startswith("So")

    # A template that loops over content parts gets OpenAI's list format.
    loops = "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
    server = await make_server(chat_template=loops)
    url = str(server.make_url("/"))
    request = {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": False}
    async with session.post(url + "tokenize", json=request) as r:
        tokens = (await r.json())["tokens"]
    async with session.post(url + "detokenize", json={"tokens": tokens}) as r:
        assert (await r.json())["prompt"] == "<hi>"


async def test_request_log_honours_max_log_len(make_server, session, caplog):
    server = await make_server(max_log_len=5)
    url = str(server.make_url("/"))
    with caplog.at_level(logging.INFO, logger="jaxserve.entrypoints.openai"):
        async with session.post(
            url + "v1/completions", json={"prompt": "Paris is the capital", "max_tokens": 1}
        ):
            pass
    (line,) = [r.getMessage() for r in caplog.records if "Received request" in r.getMessage()]
    assert "'Paris'" in line and "capital" not in line
    quiet = await make_server(disable_log_requests=True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxserve.entrypoints.openai"):
        async with session.post(
            str(quiet.make_url("/v1/completions")), json={"prompt": "a", "max_tokens": 1}
        ):
            pass
    assert not [r for r in caplog.records if "Received request" in r.getMessage()]
