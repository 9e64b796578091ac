"""The `jaxserve` command line: `jaxserve serve ...`, `jaxserve generate ...` and `jaxserve chat ...`.

Where it sits: at the very front, before `args.py`. It turns a vLLM-style command line (and a
vLLM-style `--config` YAML file) into `EngineArgs` plus `ServerArgs` (serve) or `SamplingParams`
(generate, chat), then starts the server or drives the offline `LLM` API. The flags are derived
from the `EngineArgs` and `ServerArgs` dataclasses, so a field added there becomes a flag here
with no edit; `add_engine_args` / `engine_args_from_namespace` are what a benchmark reuses, and
`make_serve_parser` / `serve_args_from_namespace` what the server's `python -m` form reuses.

Bad input never ends in a traceback: argparse refuses malformed flags, and any ValueError raised
while the engine is built or a request is checked becomes one line, `jaxserve: error: ...`, with
exit code 2 (DESIGN.md, rule 11).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from jaxserve.args import ANY, GROUPS, EngineArgs, field_default, flag_name, parse_human_int, parse_model_len
from jaxserve.entrypoints.openai.server_args import ServerArgs, validate_server_args
from jaxserve.sampling_params import SamplingParams

PROG = "jaxserve"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, and widens the option column so the long vLLM flag names stay readable."""

    def __init__(self, prog: str, **kwargs: Any):
        kwargs.setdefault("max_help_position", 40)
        super().__init__(prog, **kwargs)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the full usage of ~60 flags would bury it)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class CliError(ValueError):
    """A user mistake found after parsing (a missing prompt, an unreadable file)."""


# ---- engine flags ---------------------------------------------------------------------------


def _json_object(value: str) -> dict:
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return obj


def _model_len(value: str) -> int:
    try:
        return parse_model_len(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _memory_bytes(value: str) -> int:
    try:
        return parse_human_int(value, "kv_cache_memory_bytes")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_value(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None


def _help(f: dataclasses.Field) -> str:
    """The field's help, plus what its tier means for it, so --help never promises what is refused."""
    meta = f.metadata
    text, supported = meta["help"] or f.name.replace("_", " ") + ".", meta["supported"]
    if meta["tier"] == "C":
        text += " No effect in jaxserve."
    elif supported is not ANY and (supported or meta["tier"] == "B"):
        named = [str(v) for v in supported or () if v not in (None, False)]
        text += f" jaxserve so far: {', '.join(named)}." if named else " jaxserve so far: only the default."
    return text.replace("%", "%%")


def _flag_kwargs(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """argparse keyword arguments for one dataclass field, read off its type and `arg` metadata."""
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = set(typing.get_args(hint)) if is_union else {hint}
    kinds.discard(type(None))
    origins = {typing.get_origin(k) or k for k in kinds}
    kw: dict[str, Any] = {"default": field_default(f), "help": _help(f)}
    if f.metadata["json_value"]:
        kw["type"] = _json_value
    elif kinds == {bool}:
        # --x/--no-x for every boolean, so that a command line can switch off what a --config set.
        kw["action"] = argparse.BooleanOptionalAction
    elif dict in origins:
        kw["type"] = _json_object
    elif list in origins:
        item = next((typing.get_args(k) for k in kinds if typing.get_origin(k) is list), (str,))
        kw["nargs"] = "+"
        kw["type"] = item[0] if item and item[0] in (int, float) else str
    elif f.name == "max_model_len":
        kw["type"] = _model_len
    elif f.name == "kv_cache_memory_bytes":
        kw["type"] = _memory_bytes
    elif int in kinds:
        kw["type"] = int
    elif float in kinds:
        kw["type"] = float
    else:
        kw["type"] = str
    if f.metadata["choices"] is not None:
        kw["choices"] = f.metadata["choices"]
    kw.update(f.metadata["argparse"])
    if kw.get("action") == "append":  # one value per occurrence, as vLLM's --middleware
        kw.pop("nargs", None)
    return kw


def _add_flags(parser: argparse.ArgumentParser, classes: Sequence[type]) -> None:
    """One flag per `arg` field of `classes` (vLLM spelling, plus its short form), in vLLM's groups."""
    fields = [(cls, f) for cls in classes for f in dataclasses.fields(cls) if f.metadata]
    titles = {f.metadata["group"] for _, f in fields}
    groups = {
        t: parser.add_argument_group(t) for t in [*GROUPS, *sorted(titles - set(GROUPS))] if t in titles
    }
    hints = {cls: typing.get_type_hints(cls) for cls in classes}
    for cls, f in fields:
        flags = [flag_name(f.name)] + ([f.metadata["short"]] if f.metadata["short"] else [])
        groups[f.metadata["group"]].add_argument(*flags, dest=f.name, **_flag_kwargs(f, hints[cls][f.name]))


def _add_model_and_config(parser: argparse.ArgumentParser, model_positional: bool) -> None:
    if model_positional:
        parser.add_argument(
            "model_tag", nargs="?", default=None, metavar="MODEL", help="The model; same as --model."
        )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE.yaml",
        help="YAML mapping of flag names (underscores or dashes) to values; command-line flags override it.",
    )


def add_engine_args(
    parser: argparse.ArgumentParser, model_positional: bool = True
) -> argparse.ArgumentParser:
    """Add one flag per EngineArgs field (vLLM spelling) plus --config, and the positional MODEL."""
    _add_model_and_config(parser, model_positional)
    _add_flags(parser, [EngineArgs])
    return parser


def make_serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `vllm serve` command line on `parser`: MODEL, --config, the front-end (ServerArgs) and
    engine (EngineArgs) flags. `jaxserve serve` and `python -m jaxserve.entrypoints.openai.api_server`
    share it."""
    _add_model_and_config(parser, model_positional=True)
    _add_flags(parser, [ServerArgs, EngineArgs])
    return parser


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """The EngineArgs a parsed command line asks for; values are checked later, by EngineArgs."""
    kwargs = {name: getattr(ns, name) for name in EngineArgs.field_names() if hasattr(ns, name)}
    positional = getattr(ns, "model_tag", None)
    if positional is not None:
        if kwargs.get("model") not in (None, positional):
            raise CliError(
                f"the model is given twice: positional {positional!r} and --model {kwargs['model']!r}."
            )
        kwargs["model"] = positional
    return EngineArgs(**kwargs)


def serve_args_from_namespace(ns: argparse.Namespace) -> tuple[EngineArgs, ServerArgs]:
    """The EngineArgs and ServerArgs a parsed serve command line asks for, both validated: a value
    jaxserve cannot honour is refused (ValueError) before any model load, and each flag without
    effect is warned about once."""
    engine_args = engine_args_from_namespace(ns)
    server_args = ServerArgs(
        **{name: getattr(ns, name) for name in ServerArgs.field_names() if hasattr(ns, name)}
    )
    engine_args.validate()
    validate_server_args(server_args)
    return engine_args, server_args


def make_llm(engine_args: EngineArgs):
    """Build the offline LLM; imported late so that `--help` and flag errors stay instant."""
    from jaxserve.llm import LLM

    kwargs = {name: getattr(engine_args, name) for name in EngineArgs.field_names()}
    return LLM(**kwargs)


# ---- --config YAML --------------------------------------------------------------------------


def _config_argv(path: str, parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> list[str]:
    """The flags a vLLM --config YAML file stands for, checked against `parser`'s options.

    Scalars are written `--flag=value`, so that a value starting with a dash stays a value.
    Flags in `skip` are dropped: the command line already gave them in another spelling.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as e:
        raise CliError(f"cannot read --config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise CliError(f"--config {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise CliError(f"--config {path} must hold a mapping of flag names to values.")
    actions = {
        s: a for a in parser._actions for s in a.option_strings if s.startswith("--") and a.dest != "help"
    }
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag == "--config":
            raise CliError(f"--config {path}: unknown key {key!r}.")
        if value is None or flag in skip:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0 or (action.nargs == "?" and value is True):  # a bare flag
            if value:
                argv.append(flag)
        elif isinstance(value, dict):
            argv.append(f"{flag}={json.dumps(value)}")
        elif isinstance(value, list) and isinstance(action, argparse._AppendAction):
            argv += [f"{flag}={item}" for item in value]
        elif isinstance(value, list) and action.nargs in ("+", "*"):
            argv += [flag, *(str(v) for v in value)]
        elif isinstance(value, list):  # a flag that takes one JSON value
            argv.append(f"{flag}={json.dumps(value)}")
        else:
            argv.append(f"{flag}={value}")
    return argv


def _normalize_flags(argv: list[str]) -> list[str]:
    """vLLM also accepts --max_model_len; argparse only knows the dashed spelling."""
    out = []
    for i, token in enumerate(argv):
        if token == "--":  # everything after it is positional
            return out + argv[i:]
        if token.startswith("--") and "_" in token.split("=", 1)[0]:
            name, eq, rest = token.partition("=")
            token = name.replace("_", "-") + eq + rest
        out.append(token)
    return out


def _without_config(argv: list[str]) -> list[str]:
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == "--config":
            skip = True
        elif not token.startswith("--config="):
            out.append(token)
    return out


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, command: str | None = None
) -> argparse.Namespace:
    """parse_args with vLLM's --config: the YAML's flags go first, so the command line wins.

    `command` names the sub-command whose parser owns the engine flags (None: `parser` itself).
    The YAML flags are followed by the --config flag itself, so a list-valued flag from the file
    (nargs="+") can never swallow a positional MODEL written after it.
    """
    argv = _normalize_flags(list(sys.argv[1:] if argv is None else argv))
    ns = parser.parse_args(argv)
    if getattr(ns, "config", None) is None:
        return ns
    command = command or getattr(ns, "command", None)
    target = parser
    if command is not None:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        target = sub.choices[command]
    # A positional MODEL on the command line beats the file's `model:` like any other flag would.
    skip = frozenset({"--model"}) if getattr(ns, "model_tag", None) is not None else frozenset()
    try:
        config_argv = _config_argv(ns.config, target, skip)
    except CliError as e:
        target.error(str(e))
    cli = _without_config(argv)
    at = cli.index(command) + 1 if command is not None else 0
    return parser.parse_args(cli[:at] + config_argv + ["--config", ns.config] + cli[at:])


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


def _run_convert(ns: argparse.Namespace) -> int:
    from jaxserve.loader.orbax import convert

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
            print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
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


def build_parser() -> argparse.ArgumentParser:
    from jaxserve import __version__

    parser = ArgumentParser(
        prog=PROG,
        description="Serve and run LLMs with JAX; vLLM's command line.",
        formatter_class=_Formatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Start the OpenAI-compatible server; the flags are vLLM's (`vllm serve`).",
        usage="%(prog)s [MODEL] [options]",
        formatter_class=_Formatter,
        allow_abbrev=False,
    )
    make_serve_parser(serve)
    serve.set_defaults(func=_run_serve)

    gen = sub.add_parser(
        "generate",
        help="Complete prompts offline and print the completions.",
        description="Complete each prompt and print one block per prompt.",
        formatter_class=_Formatter,
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
        formatter_class=_Formatter,
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
        formatter_class=_Formatter,
        allow_abbrev=False,
    )
    add_engine_args(convert)
    convert.add_argument("--output", required=True, metavar="DIR", help="New (or empty) output directory.")
    convert.set_defaults(func=_run_convert)

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
        formatter_class=_Formatter,
        allow_abbrev=False,
    )
    bench_serving.add_cli_args(serve_bench)
    serve_bench.set_defaults(func=bench_serving.main)
    return parser


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parse_args(parser, argv)
    try:
        return ns.func(ns)
    except ValueError as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        raise SystemExit(2) from None
    except RuntimeError as e:
        from jaxserve.distributed import DistributedError  # imported here: --help must not load JAX

        if not isinstance(e, DistributedError):
            raise
        # the flags were fine; another process was not there
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
