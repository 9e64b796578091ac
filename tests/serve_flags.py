"""The `jaxserve serve` flag table (vLLM's flags; tiers as in the project's ARGS.md), kept here so
the tests need nothing outside the repository.

Each row: (flag, tier, vLLM's default, a non-default value, what that value parses to). The value
is written after the flag: a string is one token, a list several, True the bare flag, False the
--no- form. Tier A works; B is refused at start-up unless listed in ACCEPTED_B; C is accepted with
one warning.
"""

from __future__ import annotations

FLAGS = [
    # ---- Frontend
    ("--host", "A", None, "127.0.0.1", "127.0.0.1"),
    ("--port", "A", 8000, "8080", 8080),
    ("--api-key", "A", None, "sk-test", "sk-test"),
    ("--allowed-origins", "A", ["*"], '["http://a.example"]', ["http://a.example"]),
    ("--allowed-methods", "A", ["*"], '["GET", "POST"]', ["GET", "POST"]),
    ("--allowed-headers", "A", ["*"], '["X-Custom"]', ["X-Custom"]),
    ("--allow-credentials", "A", False, True, True),
    ("--chat-template", "A", None, "{{ messages[0]['content'] }}", "{{ messages[0]['content'] }}"),
    ("--chat-template-content-format", "A", "auto", "openai", "openai"),
    ("--response-role", "A", "assistant", "bot", "bot"),
    ("--ssl-keyfile", "A", None, "key.pem", "key.pem"),
    ("--ssl-certfile", "A", None, "cert.pem", "cert.pem"),
    ("--ssl-ca-certs", "A", None, "ca.pem", "ca.pem"),
    ("--ssl-cert-reqs", "A", 0, "2", 2),
    ("--enable-ssl-refresh", "A", False, True, True),
    ("--root-path", "A", None, "/api", "/api"),
    ("--middleware", "A", [], "json.dumps", ["json.dumps"]),
    ("--return-tokens-as-token-ids", "A", False, True, True),
    ("--enable-request-id-headers", "A", False, True, True),
    ("--enable-prompt-tokens-details", "A", False, True, True),
    ("--enable-server-load-tracking", "A", False, True, True),
    ("--disable-log-requests", "A", False, True, True),
    ("--disable-log-stats", "A", False, True, True),
    ("--max-log-len", "A", None, "100", 100),
    ("--log-config-file", "A", None, "logging.json", "logging.json"),
    ("--uvicorn-log-level", "A", "info", "debug", "debug"),
    ("--disable-uvicorn-access-log", "A", False, True, True),
    ("--disable-fastapi-docs", "A", False, True, True),
    ("--api-server-count", "B", 1, "2", 2),
    ("--headless", "B", False, True, True),
    ("--enable-auto-tool-choice", "A", False, True, True),
    ("--tool-call-parser", "A", None, "hermes", "hermes"),
    ("--tool-parser-plugin", "A", "", "plugin.py", "plugin.py"),
    ("--lora-modules", "A", None, ["a=/adapters/a"], ["a=/adapters/a"]),
    ("--prompt-adapters", "C", None, ["p=/adapters/p"], ["p=/adapters/p"]),
    # ---- ModelConfig (model: jaxserve's default model stands in for vLLM's facebook/opt-125m)
    ("--model", "A", None, "org/model", "org/model"),
    ("--served-model-name", "A", None, ["a", "b"], ["a", "b"]),
    ("--tokenizer", "A", None, "tok-dir", "tok-dir"),
    ("--tokenizer-revision", "A", None, "v1", "v1"),
    ("--tokenizer-mode", "A", "auto", "slow", "slow"),
    ("--revision", "A", None, "main", "main"),
    ("--code-revision", "A", None, "v2", "v2"),
    ("--trust-remote-code", "A", False, True, True),
    ("--hf-config-path", "A", None, "config-dir", "config-dir"),
    ("--hf-token", "A", None, "hf_secret", "hf_secret"),
    ("--download-dir", "A", None, "/tmp/hf-cache", "/tmp/hf-cache"),
    ("--config-format", "A", "auto", "hf", "hf"),
    ("--hf-overrides", "A", {}, '{"rms_norm_eps": 1e-06}', {"rms_norm_eps": 1e-06}),
    ("--dtype", "A", "auto", "bfloat16", "bfloat16"),
    ("--max-model-len", "A", None, "1k", 1000),
    ("--seed", "A", 0, "3", 3),
    ("--load-format", "A", "auto", "dummy", "dummy"),
    ("--attention-backend", "A", "auto", "reference", "reference"),
    ("--use-tqdm-on-load", "A", True, False, False),
    ("--ignore-patterns", "A", None, ["*.pt", "original/*"], ["*.pt", "original/*"]),
    ("--model-loader-extra-config", "C", {}, '{"threads": 2}', {"threads": 2}),
    ("--pt-load-map-location", "C", "cpu", "cuda:0", "cuda:0"),
    ("--quantization", "B", None, "awq", "awq"),
    ("-q", "B", None, "awq", "awq"),
    ("--kv-cache-dtype", "A", "auto", "fp8", "fp8"),
    (
        "--rope-scaling",
        "A",
        None,
        '{"rope_type": "linear", "factor": 2.0}',
        {"rope_type": "linear", "factor": 2.0},
    ),
    ("--rope-theta", "A", None, "50000", 50000.0),
    ("--enforce-eager", "A", False, True, True),
    ("--max-seq-len-to-capture", "A", 8192, "4096", 4096),
    ("--compilation-config", "A", {}, '{"cache_dir": ""}', {"cache_dir": ""}),
    ("-O", "A", {}, '{"cache_dir": ""}', {"cache_dir": ""}),
    ("--max-logprobs", "A", 20, "5", 5),
    ("--disable-sliding-window", "B", False, True, True),
    ("--disable-cascade-attn", "B", False, True, True),
    ("--skip-tokenizer-init", "B", False, True, True),
    ("--enable-prompt-embeds", "B", False, True, True),
    ("--generation-config", "A", "auto", "vllm", "vllm"),
    ("--override-generation-config", "A", {}, '{"temperature": 0.5}', {"temperature": 0.5}),
    ("--model-impl", "A", "auto", "vllm", "vllm"),
    ("--task", "A", "auto", "generate", "generate"),
    ("--logits-processor-pattern", "B", None, "my_module.*", "my_module.*"),
    ("--enable-sleep-mode", "A", False, True, True),
    # ---- CacheConfig
    ("--block-size", "A", None, "32", 32),
    ("--gpu-memory-utilization", "A", 0.9, "0.5", 0.5),
    ("--swap-space", "B", 4, "8", 8.0),
    ("--cpu-offload-gb", "B", 0, "2", 2.0),
    ("--num-gpu-blocks-override", "A", None, "64", 64),
    ("--kv-cache-memory-bytes", "A", None, "1G", 1 << 30),
    ("--enable-prefix-caching", "A", True, False, False),
    ("--prefix-caching-hash-algo", "A", "sha256", "builtin", "builtin"),
    ("--calculate-kv-scales", "A", False, True, True),
    # ---- SchedulerConfig
    ("--max-num-batched-tokens", "A", None, "4096", 4096),
    ("--max-num-seqs", "A", 256, "16", 16),
    ("--enable-chunked-prefill", "A", True, False, False),
    ("--max-num-partial-prefills", "B", 1, "2", 2),
    ("--max-long-partial-prefills", "B", 1, "2", 2),
    ("--long-prefill-token-threshold", "B", 0, "128", 128),
    ("--scheduling-policy", "A", "fcfs", "priority", "priority"),
    ("--async-scheduling", "A", None, False, False),  # unset: on
    ("--preemption-mode", "B", "recompute", "swap", "swap"),  # recompute works; swap is tier B
    ("--scheduler-delay-factor", "A", 0.0, "0.5", 0.5),
    ("--num-lookahead-slots", "C", 0, "2", 2),
    ("--num-scheduler-steps", "C", 1, "8", 8),
    ("--multi-step-stream-outputs", "C", True, False, False),
    ("--scheduler-cls", "C", "vllm.core.scheduler.Scheduler", "my.Scheduler", "my.Scheduler"),
    ("--use-v2-block-manager", "C", True, False, False),
    # ---- ParallelConfig
    ("--tensor-parallel-size", "A", 1, "2", 2),
    ("-tp", "A", 1, "2", 2),
    ("--data-parallel-size", "A", 1, "2", 2),
    ("-dp", "A", 1, "2", 2),
    ("--data-parallel-size-local", "B", None, "1", 1),
    ("--data-parallel-address", "A", None, "10.0.0.1", "10.0.0.1"),
    ("--data-parallel-rpc-port", "A", None, "13345", 13345),
    ("--data-parallel-backend", "B", "mp", "ray", "ray"),
    ("--data-parallel-start-rank", "B", None, "1", 1),
    ("--pipeline-parallel-size", "B", 1, "2", 2),
    ("-pp", "B", 1, "2", 2),
    ("--enable-expert-parallel", "B", False, True, True),
    ("--distributed-executor-backend", "B", None, "ray", "ray"),
    ("--max-parallel-loading-workers", "A", None, "2", 2),
    ("--num-processes", "A", None, "2", 2),
    ("--process-id", "A", None, "1", 1),
    ("--distributed-timeout", "A", 300.0, "60", 60.0),
    ("--disable-custom-all-reduce", "C", False, True, True),
    ("--ray-workers-use-nsight", "C", False, True, True),
    ("--worker-cls", "C", "auto", "my.Worker", "my.Worker"),
    ("--worker-extension-cls", "C", "", "my.Extension", "my.Extension"),
    ("--override-neuron-config", "C", None, '{"cores": 2}', {"cores": 2}),
    ("--device", "C", "auto", "cpu", "cpu"),
    # ---- LoRAConfig
    ("--enable-lora", "A", False, True, True),
    ("--max-loras", "A", 1, "4", 4),
    ("--max-lora-rank", "A", 16, "64", 64),
    ("--lora-dtype", "B", "auto", "bfloat16", "bfloat16"),
    ("--max-cpu-loras", "A", None, "8", 8),
    ("--fully-sharded-loras", "A", False, True, True),
    ("--enable-lora-bias", "A", False, True, True),
    ("--lora-extra-vocab-size", "B", 256, "512", 512),
    ("--long-lora-scaling-factors", "B", None, ["4.0", "8.0"], [4.0, 8.0]),
    # ---- SpeculativeConfig, DecodingConfig, ObservabilityConfig
    ("--speculative-config", "B", None, '{"method": "ngram"}', {"method": "ngram"}),
    ("--guided-decoding-backend", "A", "auto", "guidance", "guidance"),
    ("--guided-decoding-disable-fallback", "A", False, True, True),
    ("--guided-decoding-disable-any-whitespace", "A", False, True, True),
    ("--guided-decoding-disable-additional-properties", "A", False, True, True),
    ("--structured-outputs-config", "A", {}, '{"backend": "guidance"}', {"backend": "guidance"}),
    ("--reasoning-parser", "A", "", "deepseek_r1", "deepseek_r1"),
    ("--enable-reasoning", "A", None, True, True),
    ("--otlp-traces-endpoint", "A", None, "http://otel:4317", "http://otel:4317"),
    ("--collect-detailed-traces", "B", None, ["model"], ["model"]),
    ("--show-hidden-metrics-for-version", "A", None, "0.7", "0.7"),
    # ---- VllmConfig, multimodal and prompt adapters
    ("--kv-transfer-config", "C", None, '{"kv_connector": "x"}', {"kv_connector": "x"}),
    ("--kv-events-config", "C", None, '{"enable_kv_cache_events": true}', {"enable_kv_cache_events": True}),
    ("--additional-config", "C", None, '{"key": 1}', {"key": 1}),
    ("--limit-mm-per-prompt", "C", {}, '{"image": 2}', {"image": 2}),
    ("--mm-processor-kwargs", "C", None, '{"num_crops": 4}', {"num_crops": 4}),
    ("--disable-mm-preprocessor-cache", "C", False, True, True),
    ("--allowed-local-media-path", "C", "", "/data", "/data"),
    ("--enable-prompt-adapter", "C", False, True, True),
    ("--max-prompt-adapters", "C", 1, "2", 2),
    ("--max-prompt-adapter-token", "C", 0, "8", 8),
    # ---- older vLLM flags
    ("--tokenizer-pool-size", "C", 0, "4", 4),
    ("--tokenizer-pool-type", "C", "ray", "thread", "thread"),
    ("--tokenizer-pool-extra-config", "C", None, '{"a": 1}', {"a": 1}),
    ("--worker-use-ray", "B", False, True, True),  # = --distributed-executor-backend ray
    ("--max-context-len-to-capture", "C", None, "4096", 4096),
    ("--quantization-param-path", "A", None, "scales.json", "scales.json"),
    ("--image-input-type", "C", None, "pixel_values", "pixel_values"),
    ("--image-token-id", "C", None, "32000", 32000),
    ("--image-input-shape", "C", None, "1,3,336,336", "1,3,336,336"),
    ("--image-feature-size", "C", None, "576", 576),
    ("--image-processor", "C", None, "proc", "proc"),
    ("--image-processor-revision", "C", None, "main", "main"),
]

SHORT = {
    "-tp": "--tensor-parallel-size",
    "-dp": "--data-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-q": "--quantization",
    "-O": "--compilation-config",
}

# Tier-B rows whose value jaxserve accepts: implemented already, or honoured trivially.
ACCEPTED_B = {
    "--disable-sliding-window",  # caps max_model_len at the window
    "--enable-expert-parallel",  # MoE models split whole experts over the tensor-parallel devices
    "--skip-tokenizer-init",  # token-id prompts only
    "--long-prefill-token-threshold",  # the scheduler uses it
    "--disable-cascade-attn",  # there is no cascade attention to disable
    "--swap-space",  # only swap preemption, refused, would use it
    # LoRA: weights applied in float32 whatever the dtype; an adapter with extra vocabulary is
    # refused when it is read, so any budget for it is honoured.
    "--lora-dtype",
    "--lora-extra-vocab-size",
}

# Tier-A rows whose value needs files or devices to start: checked by dedicated tests.
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
    "--num-processes",
    "--process-id",
}


def long_flag(flag: str) -> str:
    return SHORT.get(flag, flag)


def dest(flag: str) -> str:
    return long_flag(flag)[2:].replace("-", "_")


def argv_for(flag: str, value) -> list[str]:
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + flag[2:]]
    if isinstance(value, list):
        return [flag, *value]
    return [flag, value]
