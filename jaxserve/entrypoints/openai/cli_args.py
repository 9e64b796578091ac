"""The command line's machinery, shared by `jaxserve` (cli.py) and the server's `python -m` form.

Where it sits: at the front, below cli.py and `entrypoints/openai/api_server.py`, which both build
their parsers here. The flags are derived from the `EngineArgs` and `ServerArgs` dataclasses (see
flags.py), so a field added there becomes a flag here with no edit; vLLM's `--config` YAML file is
read into the same flags (the command line wins); `add_engine_args` / `engine_args_from_namespace`
are what a benchmark reuses.

Bad input never ends in a traceback: argparse refuses malformed flags in one line, and
`run_command` turns any ValueError raised while the engine is built or a request is checked into
one line, `jaxserve: error: ...`, with exit code 2 (DESIGN.md, rule 11).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.args import EngineArgs
from jaxserve.entrypoints.openai.server_args import ServerArgs, validate_server_args
from jaxserve.flags import GROUPS, describe, field_default, flag_name, parse_human_int, parse_model_len

PROG = "jaxserve"


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
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
    return describe(f).replace("%", "%%")


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
    if kw.get("type") is _json_object:
        kw["help"] += f" One key at a time: {flag_name(f.name)}.KEY VALUE (nested: .A.B)."
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


def _json_object_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The long option strings of the JSON-object flags of `parser` and of its sub-commands."""
    flags: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _json_object_flags(sub)
        elif action.type is _json_object:
            flags |= {s for s in action.option_strings if s.startswith("--")}
    return flags


def _dotted_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _expand_dotted(argv: list[str], json_flags: set[str]) -> list[str]:
    """vLLM's dotted form of a JSON-object flag: `--flag.key value` (or `--flag.key=value`) sets one
    key of --flag's object, `--flag.a.b value` a nested one; a value is JSON where it parses, else a
    string. The keys given for one flag merge (the later one wins) into a single `--flag=JSON`,
    where the first of them stood. Other tokens, and a dotted name whose base is no JSON-object
    flag, are left for argparse (which refuses an unknown flag)."""
    out: list = []
    merged: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            out += argv[i:]
            break
        name, eq, value = token.partition("=")
        base, _, path = name.partition(".")
        base = base.replace("_", "-")
        if not (token.startswith("--") and path and base in json_flags):
            out.append(token)
            i += 1
            continue
        keys = path.split(".")
        if "" in keys or (not eq and i + 1 >= len(argv)):
            raise CliError(f"argument {name}: expected {base}.KEY VALUE")
        value, i = (value, i + 1) if eq else (argv[i + 1], i + 2)
        if base not in merged:
            merged[base] = {}
            out.append((base,))  # where the merged object goes
        node = merged[base]
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[keys[-1]] = _dotted_value(value)
    return [f"{t[0]}={json.dumps(merged[t[0]])}" if isinstance(t, tuple) else t for t in out]


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
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = _normalize_flags(_expand_dotted(argv, _json_object_flags(parser)))
    except CliError as e:
        parser.error(str(e))
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


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def run_command(func: Callable[[argparse.Namespace], int], ns: argparse.Namespace) -> int:
    """Run a parsed command; a ValueError (a flag or input jaxserve cannot honour) is one line and
    exit 2, a process of a multi-process run that never met the others one line and exit 1."""
    try:
        return func(ns)
    except ValueError as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        raise SystemExit(2) from None
    except RuntimeError as e:
        from jaxserve.distributed import DistributedError  # imported here: --help must not load JAX

        if not isinstance(e, DistributedError):
            raise
        # the flags were fine; another process was not there
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
