"""`jaxserve serve`: every vLLM flag parses (command line and --config YAML), --help shows it with
vLLM's default, and its tier holds: A starts, B refuses a value jaxserve lacks in one line with
exit code 2, C starts with one warning. No model is loaded: run_server is replaced."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re

import pytest
import yaml
from serve_flags import FLAGS, NEEDS_SETUP, SHORT, arg_fields, argv_for, dest, long_flag, outcome, tier
from tiny_models import TINY_LLAMA

from jaxserve.args import EngineArgs
from jaxserve.cli import build_parser, main
from jaxserve.entrypoints.openai.cli_args import (
    ArgumentParser,
    make_serve_parser,
    parse_args,
    serve_args_from_namespace,
)
from jaxserve.entrypoints.openai.server_args import ServerArgs, validate_server_args
from jaxserve.flags import GROUPS, allowed_values
from jaxserve.layers.rotary import rope_parameters

IDS = [row[0] for row in FLAGS]


@pytest.fixture(scope="module")
def parser():
    return build_parser()


@pytest.fixture
def served(monkeypatch):
    """What `jaxserve serve` handed to run_server; run_server itself returns 17."""
    calls = []

    def run_server(engine_args, server_args):
        calls.append((engine_args, server_args))
        return 17

    monkeypatch.setattr("jaxserve.entrypoints.openai.api_server.run_server", run_server)
    return calls


def _value(engine_args: EngineArgs, server_args: ServerArgs, flag: str):
    name = dest(flag)
    return getattr(server_args if name in ServerArgs.field_names() else engine_args, name)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(("jaxserve: error: ", "jaxserve serve: error: "))
    return lines[0]


def _help_entries(text: str) -> dict[str, str]:
    """--help text -> {option string: that option's entry, whitespace collapsed}. An entry starts at a
    line "  -..." and goes on over the lines indented deeper (the wrapped help)."""
    entries = {}
    for chunk in re.split(r"\n(?!   )", text):
        if chunk.startswith("  -"):
            invocation = re.split(r"\s{2,}", chunk.strip())[0]
            for option in invocation.split(", "):
                entries[option.split(" ")[0]] = " ".join(chunk.split())
    return entries


@pytest.fixture(scope="module")
def serve_help():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"].format_help()


# ---- the table: help, command line, YAML, defaults --------------------------------------------


def test_table_covers_every_flag_and_nothing_is_defined_twice():
    engine, server = EngineArgs.field_names(), ServerArgs.field_names()
    assert not engine & server
    table = {dest(flag) for flag, *_ in FLAGS}
    assert table == {f.name for f in arg_fields().values()}  # every flag has an example row
    assert set(SHORT) <= {flag for flag, *_ in FLAGS}


def test_tiers_are_read_from_the_fields_and_no_flag_is_silently_ignored():
    """The tier is the field's alone; a tier-B flag refuses some value (it never accepts every
    value without a word), and a restricted tier-A flag names what it honours in --help."""
    for flag, f in arg_fields().items():
        meta = f.metadata
        assert meta["tier"] in ("A", "B", "C"), flag
        if meta["tier"] == "B":
            assert isinstance(allowed_values(f), tuple), f"{flag}: tier B names what it honours"
        if meta["tier"] == "C":
            assert meta["supported"] is None, f"{flag}: tier C warns, it refuses nothing"


@pytest.mark.parametrize("flag, default, value, expected", FLAGS, ids=IDS)
def test_help_shows_flag_with_default(serve_help, flag, default, value, expected):
    entry = _help_entries(serve_help).get(flag)
    assert entry is not None, f"{flag} missing from serve --help"
    assert f"(default: {default})" in entry
    if tier(flag) == "C":
        assert "No effect in jaxserve" in entry
    if outcome(flag, expected) == "refused":
        assert "jaxserve so far:" in entry  # what is honoured, so --help does not promise the rest


def test_help_groups_follow_vllm(serve_help):
    titles = [
        line[:-1] for line in serve_help.splitlines() if line.endswith(":") and not line.startswith(" ")
    ]
    shown = [t for t in titles if t in GROUPS]
    assert shown == list(GROUPS)  # all present, in vLLM's order
    entries = _help_entries(serve_help)
    assert "-tp" in entries and "-dp" in entries and "-pp" in entries and "-q" in entries and "-O" in entries


def test_generate_help_has_the_engine_groups_but_no_frontend(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "\nModelConfig:" in out and "\nSchedulerConfig:" in out
    assert "\nFrontend:" not in out and "--api-key" not in out


@pytest.mark.parametrize("flag, default, value, expected", FLAGS, ids=IDS)
def test_flag_parses_on_the_command_line(parser, flag, default, value, expected):
    ns = parse_args(parser, ["serve", *argv_for(flag, value)])
    assert getattr(ns, dest(flag)) == expected
    assert expected != default  # the row would prove nothing otherwise


def test_dotted_key_equals_the_json_object(parser):
    dotted = parse_args(parser, ["serve", "--compilation-config.cache_dir", "/x"])
    assert (
        dotted.compilation_config
        == parse_args(parser, ["serve", "--compilation-config", '{"cache_dir": "/x"}']).compilation_config
    )
    assert dotted.compilation_config == {"cache_dir": "/x"}


def test_dotted_keys_merge_nest_and_parse_json(parser):
    argv = [
        "serve", "--compilation-config.cache_dir", "/x", "--compilation_config.token_buckets=[16, 64]",
        "m", "--hf-overrides.rope_scaling.factor", "2.0", "--hf-overrides.rope_scaling.rope_type", "linear",
        "--structured-outputs-config.backend", "guidance", "--speculative-config.method=ngram",
    ]  # fmt: skip
    ns = parse_args(parser, argv)
    assert ns.compilation_config == {"cache_dir": "/x", "token_buckets": [16, 64]}
    assert ns.hf_overrides == {"rope_scaling": {"factor": 2.0, "rope_type": "linear"}}
    assert ns.structured_outputs_config == {"backend": "guidance"}
    assert ns.speculative_config == {"method": "ngram"} and ns.model_tag == "m"


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--no-such-config.key", "1"], "unrecognized arguments: --no-such-config.key"),
        (["--max-num-seqs.key", "1"], "unrecognized arguments: --max-num-seqs.key"),  # not a JSON flag
        (["--compilation-config.cache_dir"], "--compilation-config.KEY VALUE"),
    ],
)
def test_a_dotted_flag_without_a_json_base_or_value_is_a_usage_error(capsys, argv, named):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2 and named in _error_line(capsys)


def test_help_shows_the_dotted_form(serve_help):
    assert "--compilation-config.KEY VALUE" in _help_entries(serve_help)["--compilation-config"]


@pytest.mark.parametrize("spelling", ["underscores", "dashes"])
@pytest.mark.parametrize("flag, default, value, expected", [r for r in FLAGS if r[0] not in SHORT], ids=[
    r[0] for r in FLAGS if r[0] not in SHORT
])  # fmt: skip
def test_flag_parses_from_yaml_config(parser, tmp_path, spelling, flag, default, value, expected):
    key = dest(flag) if spelling == "underscores" else long_flag(flag)[2:]
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({key: expected}))
    ns = parse_args(parser, ["serve", "--config", str(config)])
    assert getattr(ns, dest(flag)) == expected


@pytest.mark.parametrize("flag, default, value, expected", FLAGS, ids=IDS)
def test_defaults_match_vllm(parser, flag, default, value, expected):
    ns = parse_args(parser, ["serve"])
    assert getattr(ns, dest(flag)) == default
    assert _value(EngineArgs(), ServerArgs(), flag) == default  # LLM(**kwargs) gets the same default


def test_engine_flags_are_llm_keyword_arguments():
    """vLLM's LLM(**kwargs) takes the engine flags; EngineArgs fields are exactly what LLM accepts."""
    engine_rows = [r for r in FLAGS if dest(r[0]) in EngineArgs.field_names()]
    args = EngineArgs(**{dest(flag): expected for flag, _, _, expected in engine_rows})
    assert args.extra == {}
    assert args.max_model_len == 1000 and args.rope_theta == 50000.0


def test_command_line_overrides_yaml_and_yaml_lists(parser, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "port: 9000\nallowed-origins: ['http://a']\nmiddleware: [x.a, x.b]\nhf_token: true\n"
        "served_model_name: [m1, m2]\nrope_scaling: {rope_type: dynamic, factor: 2.0}\n"
    )
    ns = parse_args(parser, ["serve", "--config", str(config), "--port", "9001", "my-model"])
    assert ns.port == 9001 and ns.model_tag == "my-model"
    assert ns.allowed_origins == ["http://a"] and ns.middleware == ["x.a", "x.b"]
    assert ns.hf_token is True and ns.served_model_name == ["m1", "m2"]
    assert ns.rope_scaling == {"rope_type": "dynamic", "factor": 2.0}


CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(CONFIGS) if f.endswith(".yaml")))
def test_shipped_configs_parse_to_what_they_say(parser, name):
    path = os.path.join(CONFIGS, name)
    ns = parse_args(parser, ["serve", "--config", path, "some-model"])
    with open(path, encoding="utf-8") as fh:
        for key, value in yaml.safe_load(fh).items():
            assert getattr(ns, key.replace("-", "_")) == value, key


# ---- tiers: what starts, what is refused, what warns -----------------------------------------


STARTS = [(f, v, e) for f, _, v, e in FLAGS if outcome(f, e) == "starts" and f not in NEEDS_SETUP]
WARNS = [(f, v) for f, _, v, e in FLAGS if outcome(f, e) == "warns"]
REFUSED = [(f, v) for f, _, v, e in FLAGS if outcome(f, e) == "refused"]


@pytest.mark.parametrize("flag, value, expected", STARTS, ids=[r[0] for r in STARTS])
def test_honoured_value_reaches_run_server(served, caplog, flag, value, expected):
    assert main(["serve", *argv_for(flag, value)]) == 17
    (engine_args, server_args), *rest = served
    assert not rest
    assert _value(engine_args, server_args, flag) == expected
    assert _warnings(caplog) == []


@pytest.mark.parametrize("flag, value", WARNS, ids=[r[0] for r in WARNS])
def test_tier_c_flag_warns_once_and_starts(served, caplog, flag, value):
    caplog.set_level(logging.WARNING)
    assert main(["serve", *argv_for(flag, value)]) == 17
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert long_flag(flag) in warnings[0] and "no effect in jaxserve" in warnings[0]


def test_tier_c_warnings_are_logged_once_per_engine_args(caplog):
    caplog.set_level(logging.WARNING)
    args = EngineArgs(num_scheduler_steps=8, device="cpu", tokenizer_pool_size=2)
    args.validate()
    args.validate()  # create_engine_config validates again; the log must not repeat
    assert sorted(w.split()[0] for w in _warnings(caplog)) == ["--device", "--num-scheduler-steps",
                                                                "--tokenizer-pool-size"]  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-parallel-loading-workers", "0"],
        ["--max-seq-len-to-capture", "0"],
        ["--show-hidden-metrics-for-version", "seven"],
        ["--disable-cascade-attn"],
        ["--code-revision", "v2"],
        ["--guided-decoding-disable-fallback"],
    ],
)
def test_a_flag_without_effect_is_never_an_error(served, caplog, argv):
    """Flags nothing in jaxserve acts on: accepted with one warning, whatever the value."""
    caplog.set_level(logging.WARNING)
    assert main(["serve", *argv]) == 17
    (warning,) = _warnings(caplog)
    assert argv[0] in warning and "no effect in jaxserve" in warning


def test_the_hf_token_is_warned_about_but_never_logged(served, caplog):
    caplog.set_level(logging.WARNING)
    assert main(["serve", "--hf-token", "hf_secret_value"]) == 17
    (warning,) = _warnings(caplog)
    assert "--hf-token" in warning and "hf_secret_value" not in warning


@pytest.mark.parametrize("flag, value", REFUSED, ids=[r[0] for r in REFUSED])
def test_value_jaxserve_lacks_is_refused_in_one_line(served, capsys, flag, value):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv_for(flag, value)])
    assert exc.value.code == 2
    assert long_flag(flag) in _error_line(capsys)
    assert served == []  # refused before anything is built


@pytest.mark.parametrize(
    "argv, name, expected",
    [
        (["--swap-space", "0"], "swap_space", 0.0),  # no host swap: every preemption recomputes
        (["--swap-space", "8", "--preemption-mode", "swap"], "swap_space", 8.0),
        (["--lora-extra-vocab-size", "0"], "lora_extra_vocab_size", 0),
        (["--lora-dtype", "float32"], "lora_dtype", "float32"),  # the LoRA weights' own dtype
        (["--tokenizer-mode", "auto"], "tokenizer_mode", "auto"),
    ],
)
def test_values_jaxserve_honours_start_without_a_warning(served, caplog, argv, name, expected):
    assert main(["serve", *argv]) == 17
    assert getattr(served[0][0], name) == expected
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tokenizer-mode", "mistral"], "--tokenizer-mode"),
        (["--tokenizer-mode", "custom"], "--tokenizer-mode"),
        (["--tokenizer-mode", "slow"], "--tokenizer-mode"),
        (["--lora-dtype", "bfloat16"], "--lora-dtype"),
        (["--lora-dtype", "float16"], "--lora-dtype"),
        (["--lora-extra-vocab-size", "512"], "--lora-extra-vocab-size"),
        (["--speculative-config.method", "ngram"], "num_speculative_tokens"),
        (["--speculative-config", '{"method": "eagle3", "model": "x"}'], "'eagle3' is not supported"),
        (["--speculative-config", '{"model": "org/draft"}'], "'draft_model' needs num_speculative_tokens"),
        (["--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 2}'], "needs a model"),
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}',
            ],
            "disable_by_batch_size must be an integer >= 1",
        ),
        (
            ["--speculative-config", '{"model": "d", "num_speculative_tokens": 2}', "--num-processes", "2"],
            "runs on one process",
        ),
        (
            ["--speculative-config", '{"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 2}'],
            "do not apply",
        ),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
            "num_speculative_tokens",
        ),
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                '"prompt_lookup_max": 2}',
            ],
            "prompt_lookup_max",
        ),
        (["--speculative-config", '{"method": "suffix", "prompt_lookup_max": 2}'], "do not apply"),
        (["--task", "transcription"], "--task"),
        (["--runner", "draft"], "--runner"),
        (["--convert", "mm_encoder_only"], "--convert"),
        (["--model-impl", "transformers"], "--model-impl"),
        (["--config-format", "mistral"], "--config-format"),
        (["--load-format", "pt"], "--load-format"),
        (["--rope-scaling", '{"rope_type": "longrope", "factor": 4.0}'], "longrope"),
        (["--rope-scaling", '{"rope_type": "linear"}'], "factor"),
        (["--rope-theta", "0"], "--rope-theta"),
        (["--swap-space", "-1"], "swap_space"),
        (["--port", "70000"], "--port"),
        (["--ssl-keyfile", "key.pem"], "--ssl-certfile"),
        (["--chat-template", "missing.jinja"], "--chat-template"),
        (["--allowed-origins", '"*"'], "--allowed-origins"),
        (["--max-log-len", "-1"], "--max-log-len"),
        (["--worker-use-ray"], "--distributed-executor-backend ray"),
        (["--model", "a", "b"], "model"),
        (["--uvicorn-log-level", "loud"], "--uvicorn-log-level"),
        (["--hf-overrides", "[1]"], "--hf-overrides"),
        (["--attention-backend", "triton"], "--attention-backend"),
    ],
)
def test_values_jaxserve_refuses_exit_2_with_one_line(served, capsys, flags, named):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *flags])
    assert exc.value.code == 2
    assert named in _error_line(capsys)
    assert served == []


def test_a_backend_this_platform_lacks_is_refused_before_the_model_resolves(monkeypatch, capsys):
    """What needs a device is checked once the devices are known (a multi-process run joins its
    peers first), still before the model is looked for or loaded."""

    def no_model(*args, **kwargs):
        raise AssertionError("the model was resolved")

    monkeypatch.setattr("jaxserve.args_to_config.model_config_from_args", no_model)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--attention-backend", "pallas"])
    assert exc.value.code == 2
    assert "--attention-backend pallas needs a TPU or GPU" in _error_line(capsys)


@pytest.mark.parametrize("backend", ["mp", "uni"])
def test_one_host_executor_backends_are_accepted(served, backend):
    assert main(["serve", "--distributed-executor-backend", backend]) == 17
    assert served[0][0].distributed_executor_backend == backend


# ---- serve wiring -------------------------------------------------------------------------------


def test_serve_hands_validated_args_to_run_server(served):
    assert main(["serve", "org/model", "--port", "0", "--max-num-seqs", "4", "--api-key", "k"]) == 17
    engine_args, server_args = served[0]
    assert isinstance(engine_args, EngineArgs) and isinstance(server_args, ServerArgs)
    assert engine_args.model == "org/model" and engine_args.max_num_seqs == 4
    assert server_args.port == 0 and server_args.api_key == "k"
    assert main(["serve", "--model", "other/model"]) == 17
    assert served[1][0].model == "other/model"


def test_hf_token_without_a_value_means_true(served):
    assert main(["serve", "--hf-token"]) == 17
    assert served[0][0].hf_token is True


def test_module_form_reuses_the_serve_parser(tmp_path):
    parser = make_serve_parser(ArgumentParser(prog="api_server", allow_abbrev=False))
    config = tmp_path / "c.yaml"
    config.write_text("max-num-seqs: 5\nhost: 127.0.0.1\n")
    ns = parse_args(parser, ["my-model", "--config", str(config), "-tp", "1"])
    engine_args, server_args = serve_args_from_namespace(ns)
    assert engine_args.model == "my-model" and engine_args.max_num_seqs == 5
    assert server_args.host == "127.0.0.1"


def test_tls_and_log_config_files_are_checked_before_start(served, tmp_path, capsys):
    key, cert, ca, log_config = (tmp_path / n for n in ("key.pem", "cert.pem", "ca.pem", "logging.json"))
    for path in (key, cert, ca):
        path.write_text("-----BEGIN-----\n")
    log_config.write_text(json.dumps({"version": 1}))
    tls = ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-ca-certs", str(ca)]
    argv = [
        "serve",
        *tls,
        "--ssl-cert-reqs",
        "2",
        "--enable-ssl-refresh",
        "--log-config-file",
        str(log_config),
    ]
    assert main(argv) == 17
    server_args = served[0][1]
    assert server_args.ssl_cert_reqs == 2 and server_args.enable_ssl_refresh
    assert server_args.ssl_keyfile == str(key) and server_args.log_config_file == str(log_config)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--ssl-certfile", str(tmp_path / "missing.pem")])
    assert exc.value.code == 2 and "missing.pem" in _error_line(capsys)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"port": -1}, "--port"),
        ({"uvicorn_log_level": "loud"}, "--uvicorn-log-level"),
        ({"chat_template_content_format": "html"}, "--chat-template-content-format"),
        ({"ssl_cert_reqs": 3}, "--ssl-cert-reqs"),
        ({"ssl_ca_certs": "ca.pem"}, "--ssl-certfile"),
        ({"enable_ssl_refresh": True}, "--ssl-certfile"),
        ({"allowed_methods": "GET"}, "--allowed-methods"),
        ({"response_role": ""}, "--response-role"),
        ({"headless": True}, "--headless"),
        ({"api_server_count": 4}, "--api-server-count"),
    ],
)
def test_validate_server_args_refuses_in_one_line(kwargs, named):
    with pytest.raises(ValueError) as exc:
        validate_server_args(ServerArgs(**kwargs))
    message = str(exc.value)
    assert named in message and "\n" not in message


def test_validate_server_args_accepts_the_defaults_and_port_0(caplog):
    validate_server_args(ServerArgs())
    validate_server_args(ServerArgs(port=0, chat_template="{{ x }}"))
    assert _warnings(caplog) == []


# ---- flags that change how the model's config is resolved (a config.json, no weights) ----------


def _checkpoint(path, **config):
    """A model directory as far as config resolution goes: config.json and an (empty) weight file."""
    path.mkdir(parents=True, exist_ok=True)
    hf = {
        **TINY_LLAMA,
        "architectures": ["LlamaForCausalLM"],
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},  # transformers 5 spelling
        **config,
    }
    (path / "config.json").write_text(json.dumps(hf))
    (path / "model.safetensors").write_bytes(b"")
    return str(path)


def test_rope_flags_replace_the_checkpoint_rope(tmp_path):
    model = _checkpoint(tmp_path / "m")
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    hf = EngineArgs(model=model, rope_scaling=scaling, rope_theta=50000.0).create_engine_config()
    params = rope_parameters(hf.model_config.hf_config)
    assert params["rope_type"] == "dynamic" and params["factor"] == 2.0 and params["rope_theta"] == 50000.0
    # The older spelling (no rope_parameters) and a JSON string, as LLM(rope_scaling='...') passes it.
    old = _checkpoint(tmp_path / "old", rope_parameters=None, rope_theta=10000.0)
    hf = EngineArgs(model=old, rope_scaling='{"type": "linear", "factor": 4}').create_engine_config()
    params = rope_parameters(hf.model_config.hf_config)
    assert params["rope_type"] == "linear" and params["factor"] == 4 and params["rope_theta"] == 10000.0


def test_hf_config_path_replaces_the_model_config(tmp_path):
    model = _checkpoint(tmp_path / "m")
    other = _checkpoint(tmp_path / "other", max_position_embeddings=96)
    config = EngineArgs(model=model, hf_config_path=other).create_engine_config()
    assert config.model_config.max_model_len == 96
    assert config.model_config.model == model


def test_download_dir_is_the_hf_cache_hub_ids_resolve_from(tmp_path):
    repo = tmp_path / "cache" / "models--org--tiny"
    snapshot = _checkpoint(repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    config = EngineArgs(model="org/tiny", download_dir=str(tmp_path / "cache")).create_engine_config()
    assert os.path.samefile(config.model_config.model, snapshot)
    with pytest.raises(ValueError, match="local Hugging Face cache"):
        EngineArgs(model="org/tiny", download_dir=str(tmp_path / "elsewhere")).create_engine_config()


def test_disable_sliding_window_caps_max_model_len(tmp_path):
    model = _checkpoint(tmp_path / "m", sliding_window=64)
    assert (
        EngineArgs(model=model, disable_sliding_window=True).create_engine_config().model_config.max_model_len
        == 64
    )
    with pytest.raises(ValueError, match="sliding_window"):
        EngineArgs(model=model, disable_sliding_window=True, max_model_len=128).create_engine_config()


def test_ignore_patterns_may_not_exclude_the_weights(tmp_path):
    model = _checkpoint(tmp_path / "m")
    EngineArgs(model=model, ignore_patterns=["original/*", "*.pt"]).create_engine_config()
    with pytest.raises(ValueError, match="model.safetensors"):
        EngineArgs(model=model, ignore_patterns="*.safetensors").create_engine_config()


def test_gguf_quantization_needs_a_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="quantization='gguf'"):
        EngineArgs(model=_checkpoint(tmp_path / "m"), quantization="gguf").create_engine_config()


@pytest.mark.parametrize("flag", [None, "int8", "fp8", "gguf"])
def test_weight_quantization_is_resolved_from_the_flag_and_the_checkpoint(tmp_path, flag):
    model = _checkpoint(tmp_path / "m")
    if flag == "gguf":
        return test_gguf_quantization_needs_a_gguf_file(tmp_path)
    assert EngineArgs(model=model, quantization=flag).create_engine_config().model_config.quantization == flag
    converted = _checkpoint(tmp_path / "c", quantization_config={"quant_method": "jaxserve-int8"})
    if flag in (None, "int8"):  # a directory `jaxserve convert --quantization int8` wrote
        assert (
            EngineArgs(model=converted, quantization=flag).create_engine_config().model_config.quantization
            == "int8"
        )
    else:
        with pytest.raises(ValueError, match="--quantization fp8 does not match the checkpoint"):
            EngineArgs(model=converted, quantization=flag).create_engine_config()


def test_a_checkpoint_quantized_by_a_method_jaxserve_cannot_serve_is_refused_in_one_line(tmp_path, capsys):
    model = _checkpoint(tmp_path / "m", quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match=r"quantized with 'gptq' \(config.json quantization_config\)"):
        EngineArgs(model=model).create_engine_config()
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", model, "--prompt", "hi"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "'gptq'" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_a_checkpoint_method_on_a_checkpoint_without_it_is_refused(tmp_path, capsys, fmt):
    """--quantization compressed-tensors only reads a checkpoint's own quantized values; on any
    other checkpoint it would serve unquantized weights."""
    if fmt == "gguf":
        from loader.tiny_checkpoints import write_tiny_gguf

        model, has = write_tiny_gguf(str(tmp_path / "m.gguf"), tied=True).path, "GGUF"
    else:
        model, has = _checkpoint(tmp_path / "m"), "no quantization_config"
    with pytest.raises(ValueError, match=f"--quantization compressed-tensors .*{has}"):
        EngineArgs(model=model, quantization="compressed-tensors").create_engine_config()
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", model, "-q", "compressed-tensors", "--prompt", "hi"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--quantization compressed-tensors" in err and len(err.splitlines()) == 1


def test_max_model_len_may_exceed_the_trained_length_only_with_rope_scaling(tmp_path):
    model = _checkpoint(tmp_path / "m")
    with pytest.raises(ValueError, match=r"max_position_embeddings\)"):
        EngineArgs(model=model, max_model_len=257).create_engine_config()
    linear = {"rope_type": "linear", "factor": 2.0}
    cfg = EngineArgs(model=model, rope_scaling=linear).create_engine_config()
    assert cfg.model_config.max_model_len == 512  # the stretched length is the default, as in vLLM
    with pytest.raises(ValueError, match="linear rope factor"):
        EngineArgs(model=model, rope_scaling=linear, max_model_len=513).create_engine_config()
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    assert EngineArgs(model=model, rope_scaling=yarn).create_engine_config().model_config.max_model_len == 512


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-processes", "2"], "--num-processes needs --distributed-executor-backend jax"),
        (["--data-parallel-address", "10.0.0.1"], "--data-parallel-address needs --distributed-executor-backend jax"),
        (["--distributed-executor-backend", "jax", "--num-processes", "2"], "together"),
        (["--distributed-executor-backend", "jax", "--data-parallel-address", "h", "--num-processes", "2",
          "--process-id", "2"], r"--process-id must be in \[0, 2\), got 2"),
        (["--distributed-executor-backend", "jax", "-dp", "2"], "serves one replica"),
    ],
)  # fmt: skip
def test_multi_process_flags_must_hang_together(served, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2 and re.search(message, _error_line(capsys))
    assert served == []


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--scheduler-delay-factor", "-1"], "scheduler_delay_factor"),
    ],
)
def test_bad_values_of_newly_served_flags_are_one_line(served, capsys, argv, named):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2 and named in _error_line(capsys) and served == []


# ---- the flag table in docs/ ----------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_flag_table_is_the_scripts_output():
    """docs/flags.md is generated from the fields; regenerate it with
    `python scripts/flag_table.py > docs/flags.md` after changing a flag."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "flag_table", os.path.join(ROOT, "scripts", "flag_table.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(os.path.join(ROOT, "docs", "flags.md"), encoding="utf-8") as fh:
        assert fh.read() == module.markdown()
    rows = [line for line in module.markdown().splitlines() if line.startswith("| `-")]
    assert len(rows) == len(arg_fields())  # one row per flag


def test_structured_outputs_disable_fallback_key_is_warned_about_once(caplog):
    caplog.set_level(logging.WARNING)
    args = EngineArgs(structured_outputs_config={"disable_fallback": True})
    args.validate()
    args.validate()
    (warning,) = _warnings(caplog)
    assert "disable_fallback has no effect in jaxserve" in warning
