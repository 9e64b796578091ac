"""Front-end (HTTP server) settings with vLLM's flag names and defaults.

`ServerArgs` is to the server what `EngineArgs` is to the engine: `jaxserve serve` and
`python -m jaxserve.entrypoints.openai.api_server` fill one in from the command line (or a
`--config` YAML file), and `api_server.build_app` reads it. It never changes afterwards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerArgs:
    host: str | None = None
    port: int = 8000
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    allow_credentials: bool = False
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    api_key: str | None = None
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    response_role: str = "assistant"
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    enable_ssl_refresh: bool = False
    ssl_cert_reqs: int = 0
    root_path: str | None = None
    return_tokens_as_token_ids: bool = False
    enable_request_id_headers: bool = False
    log_config_file: str | None = None
    max_log_len: int | None = None
    disable_fastapi_docs: bool = False
    enable_prompt_tokens_details: bool = False
    enable_server_load_tracking: bool = False
    disable_log_requests: bool = False
    disable_log_stats: bool = False

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}
