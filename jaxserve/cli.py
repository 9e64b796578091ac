"""The `jaxserve` command line: `jaxserve serve`, `generate`, `chat`, `convert` and `bench serve`.

Where it sits: at the very front. It turns a vLLM-style command line (and a vLLM-style `--config`
YAML file; the machinery is `entrypoints/openai/cli_args.py`) into `EngineArgs` plus `ServerArgs`
(serve) or `SamplingParams` (generate, chat), then starts the server or drives the offline `LLM`
API. Heavy modules (JAX, the engine, the server) are imported inside the commands, so `--help` and
a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from jaxserve.args import EngineArgs
from jaxserve.entrypoints.openai.cli_args import (
    PROG,
    ArgumentParser,
    CliError,
    Formatter,
    add_engine_args,
    engine_args_from_namespace,
    make_serve_parser,
    one_line,
    parse_args,
    run_command,
    serve_args_from_namespace,
)
from jaxserve.sampling_params import SamplingParams


def make_llm(engine_args: EngineArgs):
    """Build the offline LLM; imported late so that `--help` and flag errors stay instant."""
    from jaxserve.llm import LLM

    kwargs = {name: getattr(engine_args, name) for name in EngineArgs.field_names()}
    return LLM(**kwargs)


# ---- sampling flags -------------------------------------------------------------------------


def _add_sampling_args(
    parser: argparse.ArgumentParser,
    temperature: float | None = None,
    with_n: bool = False,
    max_tokens_help: str = "Most tokens to generate per completion.",
) -> None:
    group = parser.add_argument_group("sampling parameters (unset = SamplingParams' default)")
    if with_n:
        group.add_argument("--n", type=int, default=None, help="Completions per prompt.")
    group.add_argument("--temperature", type=float, default=temperature, help="0 = greedy.")
    group.add_argument("--top-p", type=float, default=None, help="Nucleus sampling mass.")
    group.add_argument("--top-k", type=int, default=None, help="Keep the k likeliest tokens (0 or -1: all).")
    group.add_argument("--min-p", type=float, default=None, help="Drop tokens below min_p * top probability.")
    group.add_argument("--max-tokens", type=int, default=None, help=max_tokens_help)
    group.add_argument("--min-tokens", type=int, default=None, help="Fewest tokens before EOS/stop can end.")
    group.add_argument(
        "--sampling-seed", type=int, default=None, help="Per-request sampling seed (engine seed: --seed)."
    )
    group.add_argument("--stop", action="append", default=None, help="Stop string; repeat for several.")
    group.add_argument("--ignore-eos", action="store_true", help="Keep generating past EOS.")


def _sampling_params(ns: argparse.Namespace, base, **extra: Any):
    """The flags given, on top of the engine's defaults (which may come from generation_config)."""
    changes = {
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "top_k": ns.top_k,
        "min_p": ns.min_p,
        "max_tokens": ns.max_tokens,
        "min_tokens": ns.min_tokens,
        "seed": ns.sampling_seed,
        "stop": ns.stop,
        "ignore_eos": ns.ignore_eos or None,
        **extra,
    }
    return base.clone(**{k: v for k, v in changes.items() if v is not None})


# ---- sub-commands ---------------------------------------------------------------------------


def _read_prompts(ns: argparse.Namespace) -> list[str]:
    prompts = list(ns.prompt or [])
    if ns.prompt_file is not None:
        try:
            if ns.prompt_file == "-":
                text = sys.stdin.read()
            else:
                with open(ns.prompt_file, encoding="utf-8") as fh:
                    text = fh.read()
        except OSError as e:
            raise CliError(f"cannot read --prompt-file {ns.prompt_file}: {e.strerror or e}") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CliError("generate needs at least one --prompt or a --prompt-file with prompts.")
    return prompts


def _run_generate(ns: argparse.Namespace) -> int:
    # Input mistakes first: they should not cost a model load.
    prompts = _read_prompts(ns)
    _sampling_params(ns, SamplingParams(), n=ns.n)
    llm = make_llm(engine_args_from_namespace(ns))
    params = _sampling_params(ns, llm.get_default_sampling_params(), n=ns.n)
    show_bar = sys.stderr.isatty()
    if ns.chat:
        system = [{"role": "system", "content": ns.system_prompt}] if ns.system_prompt else []
        conversations = [system + [{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, params, use_tqdm=show_bar)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=show_bar)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        if len(prompts) > 1:
            print(f"=== prompt {i + 1}: {prompt!r}")
        for j, completion in enumerate(out.outputs):
            if len(out.outputs) > 1:
                print(f"--- completion {j + 1}")
            print(completion.text)
    return 0


def _read_line(interactive: bool) -> str | None:
    if interactive:
        try:
            return input("> ")
        except EOFError:
            print(file=sys.stderr)
            return None
    line = sys.stdin.readline()
    return line.rstrip("\n") if line else None


def convert(engine_args: EngineArgs, output: str) -> str:
    """`jaxserve convert`: load the model as the engine would (same flags) and save it converted
    (loader/orbax.py). Returns the output directory."""
    import os

    from jaxserve.loader.model_loader import load_model
    from jaxserve.loader.orbax import save_converted
    from jaxserve.loader.tokenizer import load_tokenizer
    from jaxserve.model_resolution import CONVERTED_QUANT_METHOD
    from jaxserve.sharding import make_mesh

    mc = engine_args.create_engine_config().model_config
    if mc.checkpoint_quantization is not None:
        raise ValueError(
            f"jaxserve convert does not convert a checkpoint quantized with {mc.checkpoint_quantization} "
            "yet; serve the checkpoint directly."
        )
    _, state = load_model(mc, make_mesh(1))
    source_dir = mc.model if os.path.isdir(mc.model) else None
    hf_config = dict(mc.hf_config)
    if mc.quantization is not None:  # serving the directory knows it from its config.json
        hf_config["quantization_config"] = {"quant_method": CONVERTED_QUANT_METHOD.format(mc.quantization)}
        if mc.quantization == "gguf":
            from jaxserve.loader.gguf import gguf_kernel_formats

            hf_config["quantization_config"]["kernel_formats"] = gguf_kernel_formats(mc.model)
    save_converted(output, state, hf_config, load_tokenizer(mc), source_dir, mc.dtype)
    return output


def _run_convert(ns: argparse.Namespace) -> int:
    output = convert(engine_args_from_namespace(ns), ns.output)
    print(f"Converted checkpoint written to {output}; serve it with: {PROG} serve {output}")
    return 0


def _run_chat(ns: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    _sampling_params(ns, SamplingParams())
    llm = make_llm(engine_args_from_namespace(ns))
    params = _sampling_params(ns, llm.get_default_sampling_params())
    if ns.max_tokens is None:  # like `vllm chat` through the server: answer until EOS or the context is full
        params = params.clone(max_tokens=None)
    system = [{"role": "system", "content": ns.system_prompt}] if ns.system_prompt else []
    history = list(system)
    if interactive:
        print("Type a message; /clear starts over, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while (line := _read_line(interactive)) is not None:
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/clear":
            history = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        turn = history + [{"role": "user", "content": line}]
        try:
            answer = llm.chat(turn, params, use_tqdm=False)[0].outputs[0].text
        except ValueError as e:  # e.g. the conversation outgrew max_model_len: say so, keep going
            print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            print("\n(interrupted)", file=sys.stderr)
            continue
        print(answer, flush=True)
        history = turn + [{"role": "assistant", "content": answer}]
    return 0


def _run_serve(ns: argparse.Namespace) -> int:
    engine_args, server_args = serve_args_from_namespace(ns)  # refuse bad flags before any load
    from jaxserve.entrypoints.openai import api_server

    return api_server.run_server(engine_args, server_args)


def _add_compile_check_args(parser: argparse.ArgumentParser) -> None:
    from jaxserve.aot import SCOPES
    from jaxserve.aot.chips import target_names

    group = parser.add_argument_group("TPU target")
    group.add_argument("--topology", required=True, choices=target_names(), help="The TPU slice.")
    group.add_argument(
        "--programs",
        choices=SCOPES,
        default="default",
        help="all: every bucket x every step variant; default: every bucket of the plain step and "
        "every variant at the smallest and largest bucket; plain: every bucket of the plain step; "
        "quick: the plain step at the smallest and largest bucket.",
    )
    group.add_argument(
        "--workload",
        default="1800:128",
        metavar="IN:OUT",
        help="Prompt and output tokens to project throughput for.",
    )
    group.add_argument("--json", default=None, metavar="OUT", help="Also write the full report as JSON.")


def _run_compile_check(ns: argparse.Namespace) -> int:
    from jaxserve.aot.command import parse_workload, run

    workload = parse_workload(ns.workload)  # refuse a bad value before compiling anything
    return run(engine_args_from_namespace(ns), ns.topology, ns.programs, workload, ns.json)


def build_parser() -> argparse.ArgumentParser:
    from jaxserve import __version__

    parser = ArgumentParser(
        prog=PROG,
        description="Serve and run LLMs with JAX; vLLM's command line.",
        formatter_class=Formatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Start the OpenAI-compatible server; the flags are vLLM's (`vllm serve`).",
        usage="%(prog)s [MODEL] [options]",
        formatter_class=Formatter,
        allow_abbrev=False,
    )
    make_serve_parser(serve)
    serve.set_defaults(func=_run_serve)

    gen = sub.add_parser(
        "generate",
        help="Complete prompts offline and print the completions.",
        description="Complete each prompt and print one block per prompt.",
        formatter_class=Formatter,
        allow_abbrev=False,
    )
    add_engine_args(gen)
    group = gen.add_argument_group("prompts")
    group.add_argument("--prompt", action="append", default=None, help="A prompt; repeat for several.")
    group.add_argument(
        "--prompt-file", default=None, help="File with one prompt per non-empty line ('-' = stdin)."
    )
    group.add_argument("--chat", action="store_true", help="Apply the chat template (LLM.chat).")
    group.add_argument("--system-prompt", default=None, help="System message for --chat.")
    _add_sampling_args(gen, with_n=True)
    gen.set_defaults(func=_run_generate)

    chat = sub.add_parser(
        "chat",
        help="Chat with a model in the terminal.",
        description="Interactive chat: one user message per line; /clear starts over, /exit quits.",
        formatter_class=Formatter,
        allow_abbrev=False,
    )
    add_engine_args(chat)
    chat.add_argument("--system-prompt", default=None, help="System message that opens the conversation.")
    _add_sampling_args(
        chat, temperature=0.7, max_tokens_help="Most tokens per answer; unset = until EOS or max_model_len."
    )
    chat.set_defaults(func=_run_chat)

    convert = sub.add_parser(
        "convert",
        help="Convert a checkpoint to an orbax directory that loads without conversion.",
        description="Load MODEL with the given engine flags (renaming, un-permuting, dequantizing, "
        "casting to --dtype) and save the parameters with orbax-checkpoint, plus config and tokenizer; "
        "serve the result with `jaxserve serve DIR` (--load-format orbax is detected).",
        formatter_class=Formatter,
        allow_abbrev=False,
    )
    add_engine_args(convert)
    convert.add_argument("--output", required=True, metavar="DIR", help="New (or empty) output directory.")
    convert.set_defaults(func=_run_convert)

    check = sub.add_parser(
        "tpu-compile-check",
        help="Compile the server's step programs for a TPU slice, without one (needs the tpu extra).",
        description="Compile every step program `serve` would compile on a TPU slice, with libtpu on "
        "this host: checks that each compiles, that weights, KV pool and temporaries fit the chip's "
        "memory, and projects a roofline throughput. No weight is read (a config.json or GGUF is "
        "enough). Exit 0 when all compiled and fit; else one line per failure and exit 1.",
        formatter_class=Formatter,
        allow_abbrev=False,
    )
    add_engine_args(check)
    _add_compile_check_args(check)
    check.set_defaults(func=_run_compile_check)

    from jaxserve.benchmarks import serving as bench_serving

    bench = sub.add_parser(
        "bench", help="Benchmark a running server.", description="Benchmarks, as `vllm bench`."
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    serve_bench = bench_sub.add_parser(
        "serve",
        help="Latency and throughput of an OpenAI-compatible server under load.",
        description="vLLM's serving benchmark: random prompts at a request rate against any "
        "OpenAI-compatible server (jaxserve or not).",
        formatter_class=Formatter,
        allow_abbrev=False,
    )
    bench_serving.add_cli_args(serve_bench)
    serve_bench.set_defaults(func=bench_serving.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(build_parser(), argv)
    return run_command(ns.func, ns)


if __name__ == "__main__":
    sys.exit(main())
