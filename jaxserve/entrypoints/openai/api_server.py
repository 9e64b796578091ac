"""The OpenAI-compatible HTTP server: aiohttp app, routes, middlewares, start-up and shutdown.

Where it sits: the front door. `jaxserve serve` (and `python -m
jaxserve.entrypoints.openai.api_server`, for scripts written for vLLM) builds the engine
from EngineArgs, wraps it in an AsyncLLMEngine and serves `build_app(...)` until SIGINT or
SIGTERM. Handlers validate with protocol.py and hand off to serving_completion /
serving_chat. Every client mistake is answered with a 4xx and an OpenAI-style error body;
nothing a client sends reaches the engine thread unchecked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import logging.config
import os
import sys
import uuid
from collections.abc import Sequence

from aiohttp import web
from pydantic import BaseModel, ValidationError

from jaxserve import __version__
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.entrypoints.openai import cli_args
from jaxserve.entrypoints.openai.http_middleware import (
    auth_middleware,
    cors_middleware,
    error_response,
    errors_middleware,
)
from jaxserve.entrypoints.openai.json_body import read_json_object
from jaxserve.entrypoints.openai.openapi import openapi_document
from jaxserve.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    CohereEmbedRequest,
    EmbeddingRequest,
    PoolingRequest,
)
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    bad_request,
    now,
    validation_message,
)
from jaxserve.entrypoints.openai.responses_protocol import ResponsesRequest
from jaxserve.entrypoints.openai.score_protocol import RerankRequest, ScoreRequest
from jaxserve.entrypoints.openai.server_args import ServerArgs
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxserve.entrypoints.openai.serving_pooling import OpenAIServingPooling
from jaxserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from jaxserve.entrypoints.openai.tls import ssl_context, ssl_refresher
from jaxserve.entrypoints.openai.user_middleware import load_middleware
from jaxserve.lora.modules import LoRAModules, parse_lora_modules
from jaxserve.metrics import EngineMetrics, StatsLogger

logger = logging.getLogger("jaxserve.entrypoints.openai.api_server")

# Request bodies above this are refused with 413 before they are read in full.
MAX_BODY_BYTES = 32 << 20
# A header line longer than this is a 4xx (aiohttp's own default, about uvicorn's).
MAX_HEADER_LINE_BYTES = 8190
# How the HTTP server treats connections: idle keep-alive connections close after 5 s (what
# vLLM's uvicorn does), a header line may not pass MAX_HEADER_LINE_BYTES.
HANDLER_SETTINGS = {
    "keepalive_timeout": 5.0,
    "max_line_size": MAX_HEADER_LINE_BYTES,
    "max_field_size": MAX_HEADER_LINE_BYTES,
}
STATS_LOG_INTERVAL_S = 10.0
SHUTDOWN_TIMEOUT_S = 30.0

# ---- the app -----------------------------------------------------------------------------


async def _parse(request: web.Request, model: type[BaseModel]) -> BaseModel:
    return _validate(model, await read_json_object(request))


def _validate(model: type[BaseModel], data: dict) -> BaseModel:
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e)
        err = ValueError(message)
        err.param = param
        raise err from None
    if getattr(body, "ignored_fields", None):
        logger.warning("Request fields ignored: %s", ", ".join(body.ignored_fields))
    return body


class _Routes:
    def __init__(self, engine: AsyncLLMEngine, args: ServerArgs, metrics: EngineMetrics):
        self.engine = engine
        self.args = args
        self.metrics = metrics
        self.loras = LoRAModules()
        for name, path, base in parse_lora_modules(args.lora_modules):
            if engine.config.lora_config is None:
                raise ValueError("--lora-modules needs --enable-lora.")
            engine.check_lora(self.loras.add(name, path, base))  # a bad adapter stops the start
        self.completion = OpenAIServingCompletion(engine, args, self.loras)
        self.chat = OpenAIServingChat(engine, args, self.loras)
        self.responses = OpenAIServingResponses(self.chat)
        self.pooling = OpenAIServingPooling(engine, args, self.loras)

    def add_to(self, router: web.UrlDispatcher, prefix: str = "") -> None:
        r = router
        r.add_get(prefix + "/health", self.health)
        r.add_route("*", prefix + "/ping", self.health)
        r.add_get(prefix + "/version", self.version)
        r.add_get(prefix + "/metrics", self.prometheus)
        r.add_get(prefix + "/v1/models", self.models)
        r.add_post(prefix + "/v1/completions", self.completions)
        r.add_post(prefix + "/v1/chat/completions", self.chat_completions)
        r.add_post(prefix + "/v1/responses", self.create_response)
        r.add_get(prefix + "/v1/responses/{response_id}", self.retrieve_response)
        r.add_post(prefix + "/v1/embeddings", self.embeddings)
        r.add_post(prefix + "/pooling", self.pooled)
        r.add_post(prefix + "/v2/embed", self.cohere_embed)
        r.add_post(prefix + "/classify", self.classify)
        r.add_post(prefix + "/score", self.score)
        r.add_post(prefix + "/v1/score", self.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r.add_post(prefix + path, self.rerank)
        r.add_post(prefix + "/tokenize", self.tokenize)
        r.add_post(prefix + "/detokenize", self.detokenize)
        if self.args.enable_server_load_tracking:
            r.add_get(prefix + "/load", self.load)
        if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"):
            r.add_post(prefix + "/v1/load_lora_adapter", self.load_lora_adapter)
            r.add_post(prefix + "/v1/unload_lora_adapter", self.unload_lora_adapter)
        if not self.args.disable_fastapi_docs:
            r.add_get(prefix + "/openapi.json", self.openapi)
        if os.environ.get("VLLM_SERVER_DEV_MODE", "").lower() in ("1", "true"):  # as in vLLM
            r.add_post(prefix + "/sleep", self.sleep)
            r.add_post(prefix + "/wake_up", self.wake_up)
            r.add_get(prefix + "/is_sleeping", self.is_sleeping)
            r.add_post(prefix + "/reset_prefix_cache", self.reset_prefix_cache)

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.is_running:
            return error_response(f"The engine is not running: {self.engine.dead_error}", 503)
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response({"server_load": self.engine.num_requests})

    async def models(self, request: web.Request) -> web.Response:
        mc = self.completion.model_config
        data = [
            {
                "id": name,
                "object": "model",
                "created": now(),
                "owned_by": "jaxserve",
                "root": mc.model,
                "parent": None,
                "max_model_len": mc.max_model_len,
            }
            for name in mc.served_model_name
        ]
        data += [
            {
                "id": lora.lora_name,
                "object": "model",
                "created": now(),
                "owned_by": "jaxserve",
                "root": lora.lora_path,
                "parent": lora.base_model_name or mc.served_model_name[0],
                "max_model_len": mc.max_model_len,
            }
            for lora in self.loras.all()
        ]
        return web.json_response({"object": "list", "data": data})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's run-time adapter loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING): the adapter is read
        and checked before its name is served; requests naming it then get it."""
        data = await read_json_object(request)
        name, path = data.get("lora_name"), data.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.completion.served_model_names:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.")
        lora = self.loras.add(name, path)
        try:
            await asyncio.to_thread(self.engine.check_lora, lora)
        except (ValueError, LookupError) as e:
            self.loras.remove(name)
            raise bad_request(str(e)) from None
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        data = await read_json_object(request)
        name = data.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad_request("'lora_name' must be provided.")
        try:
            self.loras.remove(name)
        except KeyError:
            return error_response(f"The lora adapter '{name}' cannot be found.", 404)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def sleep(self, request: web.Request) -> web.Response:
        """POST /sleep?level=1|2: free the weights and KV cache on the devices (--enable-sleep-mode);
        requests wait meanwhile, and those running resume after /wake_up."""
        level = request.query.get("level", "1")
        if not level.isdigit():
            raise ValueError(f"level must be 1 or 2, got {level!r}.")
        await self.engine.sleep(int(level))
        return web.Response(status=200)

    async def wake_up(self, request: web.Request) -> web.Response:
        """POST /wake_up[?tags=weights&tags=kv_cache]: take back what /sleep freed."""
        await self.engine.wake_up(request.query.getall("tags", None))
        return web.Response(status=200)

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.engine.is_sleeping()})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not await self.engine.reset_prefix_cache():
            return error_response("The prefix cache cannot be reset while requests are running.", 409)
        return web.Response(status=200)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.completion.create(await _parse(request, CompletionRequest), request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.chat.create(await _parse(request, ChatCompletionRequest), request)

    async def embeddings(self, request: web.Request) -> web.Response:
        return await self.pooling.create(await _parse(request, EmbeddingRequest), request, "embedding")

    async def cohere_embed(self, request: web.Request) -> web.Response:
        return await self.pooling.cohere_embed(await _parse(request, CohereEmbedRequest), request)

    async def pooled(self, request: web.Request) -> web.Response:
        return await self.pooling.create(await _parse(request, PoolingRequest), request, "pooling")

    async def classify(self, request: web.Request) -> web.Response:
        return await self.pooling.classify(await _parse(request, ClassificationRequest), request)

    async def score(self, request: web.Request) -> web.Response:
        return await self.pooling.score(await _parse(request, ScoreRequest), request)

    async def rerank(self, request: web.Request) -> web.Response:
        return await self.pooling.rerank(await _parse(request, RerankRequest), request)

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        return await self.responses.create(await _parse(request, ResponsesRequest), request)

    async def retrieve_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        found = self.responses.retrieve(response_id)
        if found is None:
            return error_response(f"Response with id {response_id!r} not found.", 404)
        return web.json_response(found)

    async def tokenize(self, request: web.Request) -> web.Response:
        data = await read_json_object(request)
        body = _validate(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, data)
        serving = self.chat
        serving.model_name(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = serving.render_chat(body)
        else:
            text = body.prompt
        ids = serving.tokenize(text, body.add_special_tokens)["prompt_token_ids"]
        return web.json_response({"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _parse(request, DetokenizeRequest)
        self.chat.model_name(body.model)
        tokenizer = self.chat.require_tokenizer()
        vocab = len(tokenizer)
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise ValueError(f"tokens must be in [0, {vocab}).")
        return web.json_response({"prompt": tokenizer.decode(body.tokens)})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(self.args.root_path))


def build_app(
    engine: AsyncLLMEngine, args: ServerArgs, max_body_bytes: int = MAX_BODY_BYTES
) -> web.Application:
    """The aiohttp app; it starts the engine thread on start-up and stops it on cleanup."""
    middlewares = [cors_middleware(args)]
    if args.api_key:
        middlewares.append(auth_middleware(args.api_key, args.root_path or ""))
    middlewares += [load_middleware(path) for path in args.middleware]  # see user_middleware.py
    middlewares.append(errors_middleware)
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    mc, sc = engine.config.model_config, engine.config.scheduler_config
    lora = engine.config.lora_config
    metrics = EngineMetrics(
        mc.served_model_name[0], mc.max_model_len, sc.max_num_batched_tokens, lora.max_loras if lora else None
    )
    engine.stats_callbacks.append(metrics.record)
    routes = _Routes(engine, args, metrics)
    routes.add_to(app.router)
    if args.root_path and args.root_path.strip("/"):
        routes.add_to(app.router, "/" + args.root_path.strip("/"))
    if args.enable_request_id_headers:
        app.on_response_prepare.append(_add_request_id)
    if not args.disable_log_stats:
        stats_logger = StatsLogger()
        engine.stats_callbacks.append(stats_logger.record)
        app.cleanup_ctx.append(_periodic_stats(stats_logger))

    async def start_engine(app: web.Application) -> None:
        engine.start()

    async def stop_engine(app: web.Application) -> None:
        await asyncio.to_thread(engine.shutdown)

    app.on_startup.append(start_engine)
    app.on_cleanup.append(stop_engine)
    return app


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """--enable-request-id-headers: the client's X-Request-Id back, or a fresh one."""
    response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex


def _periodic_stats(stats_logger: StatsLogger):
    async def ctx(app: web.Application):
        async def loop():
            while True:
                await asyncio.sleep(STATS_LOG_INTERVAL_S)
                line = stats_logger.line()
                if line is not None:
                    logger.info("%s", line)

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    return ctx


# ---- running ------------------------------------------------------------------------------


def configure_logging(args: ServerArgs) -> None:
    if args.log_config_file:
        with open(args.log_config_file, encoding="utf-8") as fh:
            logging.config.dictConfig(json.load(fh))
        return
    level = "DEBUG" if args.uvicorn_log_level == "trace" else args.uvicorn_log_level.upper()
    logging.basicConfig(level=level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    logging.getLogger("jaxserve").setLevel(level)


def _run_worker(engine_args) -> int:
    """`jaxserve serve` on a process other than 0: no server, no scheduler; the same runner over
    the global mesh, replaying process 0's calls until it says stop."""
    import jax

    from jaxserve import distributed
    from jaxserve.runner.model_runner import ModelRunner

    runner = ModelRunner(engine_args.create_engine_config())
    logger.info("Process %d ready; following process 0", jax.process_index())
    distributed.follow(runner, distributed.StepChannel())
    return 0


def run_server(engine_args, server_args: ServerArgs) -> int:
    """Build the engine, serve until SIGINT/SIGTERM, return the exit code.

    On a signal the listening socket closes first, in-flight requests get
    SHUTDOWN_TIMEOUT_S to finish (the engine keeps stepping), the rest are aborted,
    and the process exits 0.
    """
    configure_logging(server_args)
    ssl_ctx = ssl_context(server_args)  # a bad certificate should fail before the model loads
    if engine_args.distributed_executor_backend == "jax":
        import jax

        from jaxserve import distributed

        distributed.initialize_from_args(engine_args)  # joins the other processes
        if jax.process_index() != 0:  # no server here: replay process 0's steps
            return _run_worker(engine_args)
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    app = build_app(engine, server_args)
    if ssl_ctx is not None and server_args.enable_ssl_refresh:
        app.cleanup_ctx.append(ssl_refresher(ssl_ctx, server_args))
    host = server_args.host or None
    scheme = "https" if ssl_ctx else "http"
    logger.info("Serving %s on %s://%s:%d", engine.config.model_config.served_model_name[0], scheme,
                host or "0.0.0.0", server_args.port)  # fmt: skip
    web.run_app(
        app,
        host=host,
        port=server_args.port,
        ssl_context=ssl_ctx,
        access_log=None if server_args.disable_uvicorn_access_log else logging.getLogger("aiohttp.access"),
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        print=None,
        **HANDLER_SETTINGS,
    )
    engine.close_workers()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxserve.entrypoints.openai.api_server`: vLLM's module form of `serve`, with the
    same flags, --config file and one-line errors as `jaxserve serve`."""
    parser = cli_args.ArgumentParser(
        prog=f"{cli_args.PROG} serve",
        usage="%(prog)s [MODEL] [options]",
        description="Start the OpenAI-compatible server; the flags are vLLM's (`vllm serve`).",
        formatter_class=cli_args.Formatter,
        allow_abbrev=False,
    )
    ns = cli_args.parse_args(cli_args.make_serve_parser(parser), argv)
    return cli_args.run_command(lambda ns: run_server(*cli_args.serve_args_from_namespace(ns)), ns)


if __name__ == "__main__":
    sys.exit(main())
