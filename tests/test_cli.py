"""The `jaxserve` command line and the offline throughput benchmark, end to end on a tiny random
Llama: flags reach the engine, bad values end in one line and exit code 2, --config YAML sits
under the command line, chat keeps its history."""

from __future__ import annotations

import io
import json
import re

import pytest
from benchmark_scripts import load_benchmark

from jaxserve.cli import build_parser, main
from jaxserve.entrypoints.openai.cli_args import engine_args_from_namespace, parse_args

ENGINE_FLAGS = [
    "--max-num-batched-tokens", "64",
    "--max-num-seqs", "8",
    "--num-gpu-blocks-override", "64",
    "--block-size", "8",
    "--enforce-eager",
    "-O", '{"cache_dir": ""}',
    "--no-use-tqdm-on-load",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tiny_llama_gqa):
    return tiny_llama_gqa[0]


@pytest.fixture(scope="module")
def reference_llm(model_dir):
    """The offline API with the same settings as ENGINE_FLAGS: what the CLI must reproduce."""
    from jaxserve import LLM

    return LLM(
        model_dir,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_gpu_blocks_override=64,
        block_size=8,
        enforce_eager=True,
        compilation_config={"cache_dir": ""},
        use_tqdm_on_load=False,
    )


def _greedy(max_tokens: int):
    from jaxserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


def test_generate_prints_the_same_greedy_text_as_llm(model_dir, reference_llm, capsys):
    prompt = "The quick brown fox"
    code = main(
        ["generate", model_dir, *ENGINE_FLAGS, "--prompt", prompt, "--temperature", "0", "--max-tokens", "6"]
    )
    assert code == 0
    expected = reference_llm.generate([prompt], _greedy(6), use_tqdm=False)[0].outputs[0].text
    assert expected
    assert capsys.readouterr().out == expected + "\n"


def test_generate_chat_and_several_prompts(model_dir, reference_llm, capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Paris is\n\nOnce upon a time\n")
    argv = ["generate", "--model", model_dir, *ENGINE_FLAGS, "--prompt-file", str(prompts), "--chat"]
    assert main([*argv, "--temperature", "0", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    for prompt in ("Paris is", "Once upon a time"):
        expected = reference_llm.chat([{"role": "user", "content": prompt}], _greedy(4), use_tqdm=False)
        assert f"{prompt!r}\n{expected[0].outputs[0].text}\n" in out
    assert out.count("=== prompt ") == 2


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--dtype", "int3"], "--dtype"),
        (["--block-size", "7"], "--block-size"),
        (["--max-model-len", "lots"], "--max-model-len"),
        (["--hf-overrides", "[1]"], "--hf-overrides"),
        (["--max-num-seqs", "many"], "--max-num-seqs"),
        (["--no-such-flag", "1"], "--no-such-flag"),
    ],
)
def test_bad_flag_values_exit_2_with_one_line(model_dir, flags, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", model_dir, "--prompt", "hi", *flags])
    assert exc.value.code == 2
    assert named in _error_line(capsys)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--max-model-len", "99999"], "max_model_len"),
        (
            ["--kv-cache-dtype", "int8", "--quantization-param-path", "/no/scales.json"],
            "quantization-param-path",
        ),
        (["--quantization-param-path", "s.json", "--calculate-kv-scales"], "not both"),
        (["--preemption-mode", "swap", "--swap-space", "-2"], "swap_space"),
    ],
)
def test_values_the_engine_refuses_exit_2_with_one_line(model_dir, flags, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", model_dir, *ENGINE_FLAGS, "--prompt", "hi", *flags])
    assert exc.value.code == 2
    line = _error_line(capsys)
    assert line.startswith("jaxserve: error: ") and named in line


def test_bad_sampling_value_and_missing_prompt_exit_2(model_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", model_dir, *ENGINE_FLAGS])
    assert exc.value.code == 2
    assert "--prompt" in _error_line(capsys)
    with pytest.raises(SystemExit) as exc:
        main(["generate", model_dir, *ENGINE_FLAGS, "--prompt", "hi", "--top-p", "1.5"])
    assert exc.value.code == 2
    assert "top_p" in _error_line(capsys)


def test_config_yaml_is_read_and_the_command_line_wins(tmp_path, model_dir):
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model: {model_dir}\n"
        "max_num_seqs: 4\n"
        "max-model-len: 1K\n"
        "enable_prefix_caching: false\n"
        "enforce-eager: true\n"
        "compilation_config: {cache_dir: ''}\n"
        "served_model_name: [a, b]\n"
        "stop: ['-x', '</s>']\n"
        "tensor_parallel_size: 1\n"
    )
    parser = build_parser()
    argv = ["generate", "--config", str(config), "--max-num-seqs", "8", "--prompt", "x", "--no-enforce-eager"]
    args = engine_args_from_namespace(parse_args(parser, argv))
    assert args.model == model_dir
    assert args.max_num_seqs == 8  # the command line overrides the file
    assert args.max_model_len == 1024
    assert args.enable_prefix_caching is False
    assert args.enforce_eager is False
    assert args.compilation_config == {"cache_dir": ""}
    assert args.served_model_name == ["a", "b"]
    # A list-valued key from the file must not swallow a positional model after it.
    ns = parse_args(parser, ["generate", "--config", str(config), "other-model", "--prompt", "x"])
    assert ns.model_tag == "other-model" and ns.served_model_name == ["a", "b"]
    assert ns.stop == ["-x", "</s>"]
    assert engine_args_from_namespace(ns).model == "other-model"  # the command line wins here too
    # vLLM's underscore spelling is accepted on the command line as well.
    assert parse_args(parser, ["generate", "--max_num_seqs=3", "--prompt", "x"]).max_num_seqs == 3


@pytest.mark.parametrize("command", ["generate", "chat", "convert"])
def test_dotted_json_keys_reach_the_engine_args_of_every_command(command):
    extra = {"generate": ["--prompt", "x"], "chat": [], "convert": ["--output", "out"]}[command]
    argv = [command, "m", "--compilation-config.cache_dir", "", "-O", '{"cache_dir": "/y"}', *extra]
    assert engine_args_from_namespace(parse_args(build_parser(), argv)).compilation_config == {
        "cache_dir": "/y"
    }
    argv = [command, "m", "--lora-dtype", "float32", "--compilation-config.cache_dir", "", *extra]
    args = engine_args_from_namespace(parse_args(build_parser(), argv))
    assert args.compilation_config == {"cache_dir": ""} and args.lora_dtype == "float32"


def test_config_yaml_runs_generate(tmp_path, model_dir, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text(
        "max_num_batched_tokens: 64\nmax_num_seqs: 8\nnum_gpu_blocks_override: 64\nblock_size: 8\n"
        "enforce_eager: true\ncompilation_config: {cache_dir: ''}\nuse_tqdm_on_load: false\n"
        "max_tokens: 3\ntemperature: 0\n"
    )
    assert main(["generate", model_dir, "--config", str(config), "--prompt", "Paris"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("content", ["max_num_seqs: 4\nno_such_flag: 1\n", "- a list\n", "a: [unclosed\n"])
def test_bad_config_yaml_exits_2(tmp_path, model_dir, content, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["generate", model_dir, "--prompt", "x", "--config", str(config)])
    assert exc.value.code == 2
    assert "--config" in _error_line(capsys)


def test_chat_keeps_history_clears_and_exits(model_dir, reference_llm, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nHow are you?\n\n/clear\nHello\n/exit\nnot read\n"))
    argv = ["chat", model_dir, *ENGINE_FLAGS, "--temperature", "0", "--max-tokens", "5"]
    assert main(argv) == 0
    first = [{"role": "user", "content": "Hello"}]
    a1 = reference_llm.chat(first, _greedy(5), use_tqdm=False)[0].outputs[0].text
    second = first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "How are you?"}]
    a2 = reference_llm.chat(second, _greedy(5), use_tqdm=False)[0].outputs[0].text
    captured = capsys.readouterr()
    assert captured.out == f"{a1}\n{a2}\n{a1}\n"
    assert "cleared" in captured.err


def test_chat_ends_with_exit_0_on_eof_and_survives_a_too_long_turn(model_dir, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("word " * 300 + "\nHi\n"))
    argv = [
        "chat",
        model_dir,
        *ENGINE_FLAGS,
        "--max-model-len",
        "128",
        "--max-tokens",
        "2",
        "--sampling-seed",
        "1",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "jaxserve: error:" in captured.err and "maximum context length is 128 tokens" in captured.err
    assert len(captured.out.splitlines()) >= 1  # the second turn was answered


def test_help_lists_engine_flags_with_defaults(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "250")
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    # The help text starts on the flag's line or, for long flags, on the next one.
    assert re.search(r"--max-model-len MAX_MODEL_LEN\s+.*\(default: None\)", out)
    assert re.search(r"--max-num-seqs MAX_NUM_SEQS\s+.*\(default: 256\)", out)
    assert re.search(r"--enable-prefix-caching, --no-enable-prefix-caching\s+.*\(default: True\)", out)
    assert re.search(r"--tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE", out)
    assert "--compilation-config COMPILATION_CONFIG, -O COMPILATION_CONFIG" in out


def test_throughput_benchmark_writes_json(model_dir, tmp_path, capsys):
    out_json = tmp_path / "result.json"
    argv = ["--model", model_dir, "--num-prompts", "4", "--input-len", "8", "--output-len", "4"]
    assert load_benchmark("throughput").main([*argv, "--output-json", str(out_json), *ENGINE_FLAGS]) == 0
    result = json.loads(out_json.read_text())
    assert set(result) == {"config", "jaxserve", "transformers", "ratio"}
    for side in ("jaxserve", "transformers"):
        numbers = result[side]
        for key in (
            "elapsed",
            "requests_per_second",
            "tokens_per_second",
            "output_tokens_per_second",
            "startup_s",
        ):
            assert numbers[key] > 0, (side, key)
        assert numbers["output_tokens"] == 16 and numbers["prompt_tokens"] == 32
    assert result["ratio"] > 0
    assert result["config"]["num_prompts"] == 4
    out = capsys.readouterr().out
    assert out.count("Throughput: ") == 2 and "ratio" in out


def test_throughput_benchmark_times_sampling_costs(model_dir, tmp_path, capsys):
    out_json = tmp_path / "costs.json"
    argv = ["--model", model_dir, "--num-prompts", "2", "--input-len", "8", "--output-len", "4"]
    argv += ["--sampling-costs", "--no-hf-baseline", "--output-json", str(out_json), *ENGINE_FLAGS]
    assert load_benchmark("throughput").main(argv) == 0
    costs = json.loads(out_json.read_text())["sampling_costs"]
    assert set(costs) == {"plain", "penalties", "logprobs5", "prompt_logprobs1"}
    assert costs["plain"]["ratio_to_plain"] == 1.0
    assert all(r["output_tokens_per_second"] > 0 and r["ratio_to_plain"] > 0 for r in costs.values())
    assert "x plain" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["--help"], ["serve", "--help"], ["generate", "--help"], ["bench", "serve", "--help"]]
)
def test_help_answers_without_loading_jax(argv):
    """--help is what people run first and often: it must not pay JAX's start-up (over a second)."""
    import subprocess
    import sys

    script = (
        "import sys\nfrom jaxserve.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "loaded = sorted(m for m in ('jax', 'jaxlib', 'flax', 'transformers', 'torch') if m in sys.modules)\n"
        "print('loaded:' + ','.join(loaded))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    help_text, loaded = done.stdout.rsplit("loaded:", 1)
    assert "usage: jaxserve" in help_text
    assert loaded.strip() == "", f"jaxserve {' '.join(argv)} imported {loaded}"
