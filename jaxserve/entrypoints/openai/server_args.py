"""Front-end (HTTP server) settings with vLLM's flag names and defaults.

`ServerArgs` is to the server what `EngineArgs` is to the engine: `jaxserve serve` and
`python -m jaxserve.entrypoints.openai.api_server` fill one in from the command line (or a
`--config` YAML file), check it with `validate_server_args` before the model loads, and
`api_server.build_app` reads it. It never changes afterwards. Every field is also a flag
(group "Frontend"; see `jaxserve.args.arg` for what the metadata means).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser, import_tool_parser_plugin
from jaxserve.entrypoints.openai.user_middleware import load_middleware
from jaxserve.flags import G, arg, check_flag_values, flag_name

logger = logging.getLogger(__name__)

_F = G.FRONTEND
SSL_CERT_REQS = (0, 1, 2)  # ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED


@dataclass(frozen=True)
class ServerArgs:
    host: str | None = arg(_F, None, "Host name or address to listen on; unset = all interfaces.")
    port: int = arg(_F, 8000, "Port to listen on (0 = any free port).")
    uvicorn_log_level: str = arg(
        _F,
        "info",
        "Log level of the HTTP server's access log.",
        choices=("debug", "info", "warning", "error", "critical", "trace"),
    )
    disable_uvicorn_access_log: bool = arg(_F, False, "No access log line per request.")
    allow_credentials: bool = arg(_F, False, "CORS: allow credentials.")
    allowed_origins: list[str] = arg(
        _F, help="CORS: allowed origins, a JSON list.", factory=lambda: ["*"], json_value=True
    )
    allowed_methods: list[str] = arg(
        _F, help="CORS: allowed methods, a JSON list.", factory=lambda: ["*"], json_value=True
    )
    allowed_headers: list[str] = arg(
        _F, help="CORS: allowed headers, a JSON list.", factory=lambda: ["*"], json_value=True
    )
    api_key: str | None = arg(_F, None, "Bearer token required on /v1/* when set.")
    chat_template: str | None = arg(_F, None, "Chat template: a file path or the Jinja text itself.")
    chat_template_content_format: str = arg(
        _F,
        "auto",
        "How message content reaches the template: string, or openai (a list of parts).",
        choices=("auto", "string", "openai"),
    )
    response_role: str = arg(_F, "assistant", "Role of the generated chat message.")
    ssl_keyfile: str | None = arg(_F, None, "TLS private key file.")
    ssl_certfile: str | None = arg(_F, None, "TLS certificate file.")
    ssl_ca_certs: str | None = arg(_F, None, "CA certificates file for client certificates.")
    enable_ssl_refresh: bool = arg(_F, False, "Reload the TLS files when they change.")
    ssl_cert_reqs: int = arg(
        _F,
        0,
        "Client certificate: 0 none, 1 optional, 2 required (Python's ssl.CERT_*).",
        choices=SSL_CERT_REQS,
    )
    root_path: str | None = arg(_F, None, "Path prefix when behind a path-based proxy.")
    return_tokens_as_token_ids: bool = arg(_F, False, "Logprob tokens as 'token_id:N'.")
    enable_request_id_headers: bool = arg(_F, False, "Add X-Request-Id to responses.")
    log_config_file: str | None = arg(_F, None, "JSON logging configuration file.")
    max_log_len: int | None = arg(_F, None, "Most prompt characters/ids printed per logged request.")
    disable_fastapi_docs: bool = arg(_F, False, "Do not publish /openapi.json.")
    enable_prompt_tokens_details: bool = arg(_F, False, "Report usage.prompt_tokens_details.cached_tokens.")
    enable_server_load_tracking: bool = arg(_F, False, "Track in-flight requests (server_load_metrics).")
    disable_log_requests: bool = arg(_F, False, "Do not log each request.")
    disable_log_stats: bool = arg(_F, False, "Do not log engine statistics.")
    middleware: list[str] = arg(
        _F,
        help="Import path of an aiohttp middleware, an async function (request, handler); repeat for several.",
        factory=list,
        action="append",
    )
    # Not served yet: refused unless left at vLLM's default.
    api_server_count: int = arg(_F, 1, "HTTP server processes.", tier="B")
    headless: bool = arg(_F, False, "Run the engine without an HTTP server.", tier="B")
    lora_modules: list[str] | None = arg(
        _F,
        None,
        'LoRA adapters to serve, each name=path or JSON {"name", "path", "base_model_name"} (needs --enable-lora).',
        nargs="+",
    )
    enable_auto_tool_choice: bool = arg(
        _F, False, 'Let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser.'
    )
    tool_call_parser: str | None = arg(
        _F, None, "Parser of the model's tool calls: hermes, llama3_json, mistral, pythonic, or a plugin's."
    )
    tool_parser_plugin: str = arg(_F, "", "Python file that registers a tool parser (register_tool_parser).")
    prompt_adapters: list[str] | None = arg(_F, None, "Prompt adapters (name=path).", tier="C")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


def validate_server_args(args: ServerArgs) -> None:
    """Refuse, before the model loads, settings the server would only trip on later (a missing
    TLS file after minutes of loading); one ValueError line naming the flag. Logs one warning per
    flag that has no effect in jaxserve."""
    warnings = check_flag_values(args)  # choices, and the values jaxserve cannot honour yet
    if not isinstance(args.port, int) or not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port!r}.")
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, name)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(
                f"{flag_name(name)} must be a JSON list of strings (e.g. '[\"*\"]'), got {value!r}."
            )
    if args.ssl_certfile is None:  # a certfile alone may hold the key too (one PEM file)
        for name in ("ssl_keyfile", "ssl_ca_certs", "enable_ssl_refresh", "ssl_cert_reqs"):
            if getattr(args, name):
                raise ValueError(f"{flag_name(name)} needs --ssl-certfile.")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "log_config_file"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag_name(name)} {path!r}: no such file.")
    template = args.chat_template
    if template is not None and not os.path.isfile(template) and not any(c in template for c in "{}\n"):
        raise ValueError(f"--chat-template {template!r} is neither a readable file nor a Jinja template.")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}.")
    if args.tool_parser_plugin:
        import_tool_parser_plugin(args.tool_parser_plugin)
    for path in args.middleware:
        load_middleware(path)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser.")
    if args.tool_call_parser:
        get_tool_parser(args.tool_call_parser)
    if not args.response_role:
        raise ValueError("--response-role must not be empty.")
    for line in warnings:
        logger.warning(line)
