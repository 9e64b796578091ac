"""Example values for every `jaxserve serve` flag, with vLLM's default for each, so the tests need
nothing outside the repository.

Each row: (flag, vLLM's default, a non-default value, what that value parses to). The value is
written after the flag: a string is one token, a list several, True the bare flag, False the --no-
form. Tiers are not here: they are the fields' own (`arg(..., tier=...)` in args_fields.py and
server_args.py), and what a value leads to (starts, refused, warned about) is read from them.
"""

from __future__ import annotations

import dataclasses

from jaxserve.args import EngineArgs
from jaxserve.entrypoints.openai.server_args import ServerArgs
from jaxserve.flags import allowed_values, flag_name

FLAGS = [
    # ---- Frontend
    ("--host", None, "127.0.0.1", "127.0.0.1"),
    ("--port", 8000, "8080", 8080),
    ("--api-key", None, "sk-test", "sk-test"),
    ("--allowed-origins", ["*"], '["http://a.example"]', ["http://a.example"]),
    ("--allowed-methods", ["*"], '["GET", "POST"]', ["GET", "POST"]),
    ("--allowed-headers", ["*"], '["X-Custom"]', ["X-Custom"]),
    ("--allow-credentials", False, True, True),
    ("--chat-template", None, "{{ messages[0]['content'] }}", "{{ messages[0]['content'] }}"),
    ("--chat-template-content-format", "auto", "openai", "openai"),
    ("--response-role", "assistant", "bot", "bot"),
    ("--ssl-keyfile", None, "key.pem", "key.pem"),
    ("--ssl-certfile", None, "cert.pem", "cert.pem"),
    ("--ssl-ca-certs", None, "ca.pem", "ca.pem"),
    ("--ssl-cert-reqs", 0, "2", 2),
    ("--enable-ssl-refresh", False, True, True),
    ("--root-path", None, "/api", "/api"),
    ("--middleware", [], "json.dumps", ["json.dumps"]),
    ("--return-tokens-as-token-ids", False, True, True),
    ("--enable-request-id-headers", False, True, True),
    ("--enable-prompt-tokens-details", False, True, True),
    ("--enable-server-load-tracking", False, True, True),
    ("--disable-log-requests", False, True, True),
    ("--disable-log-stats", False, True, True),
    ("--max-log-len", None, "100", 100),
    ("--log-config-file", None, "logging.json", "logging.json"),
    ("--uvicorn-log-level", "info", "debug", "debug"),
    ("--disable-uvicorn-access-log", False, True, True),
    ("--disable-fastapi-docs", False, True, True),
    ("--api-server-count", 1, "2", 2),
    ("--headless", False, True, True),
    ("--enable-auto-tool-choice", False, True, True),
    ("--tool-call-parser", None, "hermes", "hermes"),
    ("--tool-parser-plugin", "", "plugin.py", "plugin.py"),
    ("--lora-modules", None, ["a=/adapters/a"], ["a=/adapters/a"]),
    ("--prompt-adapters", None, ["p=/adapters/p"], ["p=/adapters/p"]),
    # ---- ModelConfig (model: jaxserve's default model stands in for vLLM's facebook/opt-125m)
    ("--model", None, "org/model", "org/model"),
    ("--served-model-name", None, ["a", "b"], ["a", "b"]),
    ("--tokenizer", None, "tok-dir", "tok-dir"),
    ("--tokenizer-revision", None, "v1", "v1"),
    ("--tokenizer-mode", "auto", "slow", "slow"),
    ("--revision", None, "main", "main"),
    ("--code-revision", None, "v2", "v2"),
    ("--trust-remote-code", False, True, True),
    ("--hf-config-path", None, "config-dir", "config-dir"),
    ("--hf-token", None, "hf_secret", "hf_secret"),
    ("--download-dir", None, "/tmp/hf-cache", "/tmp/hf-cache"),
    ("--config-format", "auto", "hf", "hf"),
    ("--hf-overrides", {}, '{"rms_norm_eps": 1e-06}', {"rms_norm_eps": 1e-06}),
    ("--dtype", "auto", "bfloat16", "bfloat16"),
    ("--max-model-len", None, "1k", 1000),
    ("--seed", 0, "3", 3),
    ("--load-format", "auto", "dummy", "dummy"),
    ("--attention-backend", "auto", "reference", "reference"),
    ("--use-tqdm-on-load", True, False, False),
    ("--ignore-patterns", None, ["*.pt", "original/*"], ["*.pt", "original/*"]),
    ("--model-loader-extra-config", {}, '{"threads": 2}', {"threads": 2}),
    ("--pt-load-map-location", "cpu", "cuda:0", "cuda:0"),
    ("--quantization", None, "awq", "awq"),
    ("-q", None, "awq", "awq"),
    ("--kv-cache-dtype", "auto", "fp8", "fp8"),
    (
        "--rope-scaling",
        None,
        '{"rope_type": "linear", "factor": 2.0}',
        {"rope_type": "linear", "factor": 2.0},
    ),
    ("--rope-theta", None, "50000", 50000.0),
    ("--enforce-eager", False, True, True),
    ("--max-seq-len-to-capture", 8192, "4096", 4096),
    ("--compilation-config", {}, '{"cache_dir": ""}', {"cache_dir": ""}),
    ("-O", {}, '{"cache_dir": ""}', {"cache_dir": ""}),
    ("--max-logprobs", 20, "5", 5),
    ("--disable-sliding-window", False, True, True),
    ("--disable-cascade-attn", False, True, True),
    ("--skip-tokenizer-init", False, True, True),
    ("--enable-prompt-embeds", False, True, True),
    ("--generation-config", "auto", "vllm", "vllm"),
    ("--override-generation-config", {}, '{"temperature": 0.5}', {"temperature": 0.5}),
    ("--model-impl", "auto", "vllm", "vllm"),
    ("--task", "auto", "generate", "generate"),
    ("--runner", "auto", "generate", "generate"),
    ("--convert", "auto", "none", "none"),
    ("--pooler-config", None, '{"pooling_type": "MEAN"}', {"pooling_type": "MEAN"}),
    ("--override-pooler-config", None, '{"normalize": false}', {"normalize": False}),
    ("--logits-processor-pattern", None, "my_module.*", "my_module.*"),
    ("--enable-sleep-mode", False, True, True),
    # ---- CacheConfig
    ("--block-size", None, "32", 32),
    ("--gpu-memory-utilization", 0.9, "0.5", 0.5),
    ("--swap-space", 4, "8", 8.0),
    ("--cpu-offload-gb", 0, "2", 2.0),
    ("--num-gpu-blocks-override", None, "64", 64),
    ("--kv-cache-memory-bytes", None, "1G", 1 << 30),
    ("--enable-prefix-caching", True, False, False),
    ("--prefix-caching-hash-algo", "sha256", "builtin", "builtin"),
    ("--calculate-kv-scales", False, True, True),
    # ---- SchedulerConfig
    ("--max-num-batched-tokens", None, "4096", 4096),
    ("--max-num-seqs", 256, "16", 16),
    ("--enable-chunked-prefill", True, False, False),
    ("--max-num-partial-prefills", 1, "2", 2),
    ("--max-long-partial-prefills", 1, "2", 2),
    ("--long-prefill-token-threshold", 0, "128", 128),
    ("--scheduling-policy", "fcfs", "priority", "priority"),
    ("--async-scheduling", None, False, False),  # unset: on
    ("--preemption-mode", "recompute", "swap", "swap"),
    ("--scheduler-delay-factor", 0.0, "0.5", 0.5),
    ("--num-lookahead-slots", 0, "2", 2),
    ("--num-scheduler-steps", 1, "8", 8),
    ("--multi-step-stream-outputs", True, False, False),
    ("--scheduler-cls", "vllm.core.scheduler.Scheduler", "my.Scheduler", "my.Scheduler"),
    ("--use-v2-block-manager", True, False, False),
    # ---- ParallelConfig
    ("--tensor-parallel-size", 1, "2", 2),
    ("-tp", 1, "2", 2),
    ("--data-parallel-size", 1, "2", 2),
    ("-dp", 1, "2", 2),
    ("--data-parallel-size-local", None, "1", 1),
    ("--data-parallel-address", None, "10.0.0.1", "10.0.0.1"),
    ("--data-parallel-rpc-port", None, "13345", 13345),
    ("--data-parallel-backend", "mp", "ray", "ray"),
    ("--data-parallel-start-rank", None, "1", 1),
    ("-dpl", None, "1", 1),
    ("-dpa", None, "10.0.0.1", "10.0.0.1"),
    ("-dpp", None, "13345", 13345),
    ("-dpb", "mp", "ray", "ray"),
    ("-dpr", None, "1", 1),
    ("--pipeline-parallel-size", 1, "2", 2),
    ("-pp", 1, "2", 2),
    ("--enable-expert-parallel", False, True, True),
    ("--distributed-executor-backend", None, "ray", "ray"),
    ("--max-parallel-loading-workers", None, "2", 2),
    ("--num-processes", None, "2", 2),
    ("--process-id", None, "1", 1),
    ("--distributed-timeout", 300.0, "60", 60.0),
    ("--disable-custom-all-reduce", False, True, True),
    ("--ray-workers-use-nsight", False, True, True),
    ("--worker-cls", "auto", "my.Worker", "my.Worker"),
    ("--worker-extension-cls", "", "my.Extension", "my.Extension"),
    ("--override-neuron-config", None, '{"cores": 2}', {"cores": 2}),
    ("--device", "auto", "cpu", "cpu"),
    # ---- LoRAConfig
    ("--enable-lora", False, True, True),
    ("--max-loras", 1, "4", 4),
    ("--max-lora-rank", 16, "64", 64),
    ("--lora-dtype", "auto", "float32", "float32"),
    ("--max-cpu-loras", None, "8", 8),
    ("--fully-sharded-loras", False, True, True),
    ("--enable-lora-bias", False, True, True),
    ("--lora-extra-vocab-size", 256, "512", 512),
    ("--long-lora-scaling-factors", None, ["4.0", "8.0"], [4.0, 8.0]),
    # ---- SpeculativeConfig, DecodingConfig, ObservabilityConfig
    (
        "--speculative-config",
        None,
        '{"method": "ngram", "num_speculative_tokens": 3}',
        {"method": "ngram", "num_speculative_tokens": 3},
    ),
    ("--guided-decoding-backend", "auto", "guidance", "guidance"),
    ("--guided-decoding-disable-fallback", False, True, True),
    ("--guided-decoding-disable-any-whitespace", False, True, True),
    ("--guided-decoding-disable-additional-properties", False, True, True),
    ("--structured-outputs-config", {}, '{"backend": "guidance"}', {"backend": "guidance"}),
    ("--reasoning-parser", "", "deepseek_r1", "deepseek_r1"),
    ("--enable-reasoning", None, True, True),
    ("--otlp-traces-endpoint", None, "http://otel:4317", "http://otel:4317"),
    ("--collect-detailed-traces", None, ["model"], ["model"]),
    ("--show-hidden-metrics-for-version", None, "0.7", "0.7"),
    # ---- VllmConfig, multimodal and prompt adapters
    ("--kv-transfer-config", None, '{"kv_connector": "x"}', {"kv_connector": "x"}),
    ("--kv-events-config", None, '{"enable_kv_cache_events": true}', {"enable_kv_cache_events": True}),
    ("--additional-config", None, '{"key": 1}', {"key": 1}),
    ("--limit-mm-per-prompt", {}, '{"image": 2}', {"image": 2}),
    ("--mm-processor-kwargs", None, '{"num_crops": 4}', {"num_crops": 4}),
    ("--disable-mm-preprocessor-cache", False, True, True),
    ("--allowed-local-media-path", "", "/data", "/data"),
    ("--enable-prompt-adapter", False, True, True),
    ("--max-prompt-adapters", 1, "2", 2),
    ("--max-prompt-adapter-token", 0, "8", 8),
    # ---- older vLLM flags
    ("--tokenizer-pool-size", 0, "4", 4),
    ("--tokenizer-pool-type", "ray", "thread", "thread"),
    ("--tokenizer-pool-extra-config", None, '{"a": 1}', {"a": 1}),
    ("--worker-use-ray", False, True, True),
    ("--max-context-len-to-capture", None, "4096", 4096),
    ("--quantization-param-path", None, "scales.json", "scales.json"),
    ("--image-input-type", None, "pixel_values", "pixel_values"),
    ("--image-token-id", None, "32000", 32000),
    ("--image-input-shape", None, "1,3,336,336", "1,3,336,336"),
    ("--image-feature-size", None, "576", 576),
    ("--image-processor", None, "proc", "proc"),
    ("--image-processor-revision", None, "main", "main"),
]


# Rows whose value needs files or devices to start: checked by dedicated tests.
NEEDS_SETUP = {
    "--middleware",  # an importable middleware
    "--lora-modules",  # adapter directories, and --enable-lora
    "--quantization-param-path",  # a file
    "--enable-auto-tool-choice",  # needs --tool-call-parser
    "--tool-parser-plugin",  # a file
    "--enable-reasoning",  # needs --reasoning-parser
    "--ssl-keyfile",
    "--ssl-certfile",
    "--ssl-ca-certs",
    "--ssl-cert-reqs",
    "--enable-ssl-refresh",
    "--log-config-file",
    "--tensor-parallel-size",
    "-tp",
    "--data-parallel-size",
    "-dp",
    # the multi-process flags go together, with --distributed-executor-backend jax
    "--data-parallel-address",
    "--data-parallel-rpc-port",
    "-dpa",
    "-dpp",
    "--num-processes",
    "--process-id",
}


def arg_fields() -> dict[str, dataclasses.Field]:
    """Every flag's field (long spelling), from ServerArgs and EngineArgs."""
    return {
        flag_name(f.name): f
        for cls in (ServerArgs, EngineArgs)
        for f in dataclasses.fields(cls)
        if f.metadata
    }


SHORT = {f.metadata["short"]: flag for flag, f in arg_fields().items() if f.metadata["short"]}


def long_flag(flag: str) -> str:
    return SHORT.get(flag, flag)


def dest(flag: str) -> str:
    return long_flag(flag)[2:].replace("-", "_")


def tier(flag: str) -> str:
    return arg_fields()[long_flag(flag)].metadata["tier"]


def outcome(flag: str, value) -> str:
    """What `jaxserve serve FLAG VALUE` leads to by the field's metadata: "warns" (tier C),
    "starts" (a value jaxserve honours) or "refused" (exit 2, one line naming the flag)."""
    f = arg_fields()[long_flag(flag)]
    if f.metadata["tier"] == "C":
        return "warns"
    allowed = allowed_values(f)
    return "starts" if allowed is None or value in allowed else "refused"


def argv_for(flag: str, value) -> list[str]:
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + flag[2:]]
    if isinstance(value, list):
        return [flag, *value]
    return [flag, value]
