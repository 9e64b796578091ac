"""Flags declared once, as dataclass fields: the machinery behind `EngineArgs` and `ServerArgs`.

Where it sits: at the bottom of the command-line side, imported by `args_fields.py` (the engine's flag
table), `entrypoints/openai/server_args.py` (the server's) and `entrypoints/openai/cli_args.py`
(which turns the fields into argparse flags). A field made with `arg` carries vLLM's help group,
its tier (A works, B is refused unless supported, C is accepted and warned about) and vLLM's
value list, so adding a field adds its flag, its help and its refusal in one place.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import field
from typing import Any


def arg(
    group: str,
    default: Any = None,
    help: str = "",
    *,
    tier: str = "A",
    choices: tuple | None = None,
    supported: tuple | None = None,
    short: str | None = None,
    factory: Any = None,
    json_value: bool = False,
    secret: bool = False,
    **argparse_kwargs: Any,
) -> Any:
    """A dataclass field that is also a vLLM flag, so that adding a field adds the flag.

    group: vLLM's help group. tier: "A" works; "B" accepts only `supported` (by
    default: only the default) and refuses any other value by name; "C" is accepted and warned
    about, it has no effect on JAX. choices: vLLM's full value list, so an existing command line
    parses and the values jaxserve lacks are refused by name rather than called invalid.
    json_value: the flag takes one JSON value (vLLM's spelling for list flags such as CORS).
    secret: the value is never written to the log (a token). Further keywords go to argparse
    unchanged.
    """
    if tier not in ("A", "B", "C"):
        raise ValueError(f"tier must be A, B or C, got {tier!r}.")
    metadata = {
        "group": group,
        "help": help,
        "tier": tier,
        "choices": choices,
        "supported": supported,
        "short": short,
        "json_value": json_value,
        "secret": secret,
        "argparse": argparse_kwargs,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def allowed_values(f: dataclasses.Field) -> tuple | None:
    """The values of an `arg` field that jaxserve honours (None: every value): `supported`, else
    the default alone for tier B, else vLLM's value list."""
    meta = f.metadata
    if meta["supported"] is not None:
        return meta["supported"]
    return (field_default(f),) if meta["tier"] == "B" else meta["choices"]


def describe(f: dataclasses.Field) -> str:
    """The field's help, plus what its tier means for it, so that --help and the flag table never
    promise what is refused or ignored."""
    meta = f.metadata
    text = meta["help"] or f.name.replace("_", " ") + "."
    if meta["tier"] == "C":
        return text + " No effect in jaxserve."
    if meta["supported"] is None:
        return text + (" jaxserve so far: only the default." if meta["tier"] == "B" else "")
    named = [str(v) for v in meta["supported"] if v is not None and v is not False]
    return text + (
        f" jaxserve so far: {', '.join(named)}." if named else " jaxserve so far: only the default."
    )


def check_flag_values(args: Any) -> list[str]:
    """Refuse a value of an `arg` field that jaxserve cannot honour (ValueError, one line naming
    the flag and what is supported); return one warning per tier-C flag set, for the caller to
    log once. A value equal to the default asks for nothing and passes."""
    warnings = []
    for f in dataclasses.fields(args):
        meta, value, default = f.metadata, getattr(args, f.name), field_default(f)
        if not meta or value == default:
            continue
        if meta["tier"] == "C":
            shown = "" if meta["secret"] else f"={value!r}"
            warnings.append(f"{flag_name(f.name)} has no effect in jaxserve; ignoring {f.name}{shown}.")
            continue
        allowed = allowed_values(f)
        if allowed is not None and value not in allowed:
            raise ValueError(
                f"{flag_name(f.name)}={value!r} ({f.name}) is not supported by jaxserve yet; "
                f"supported: {', '.join(repr(v) for v in allowed)}."
            )
    return warnings


def parse_model_len(value: int | str | None) -> int | None:
    """vLLM's human-friendly lengths: 1k = 1000, 1K = 1024, 25.6k = 25600."""
    return parse_human_int(value, "max_model_len", "a length (e.g. 2048, 1k, 1K, 25.6k)")


def parse_human_int(
    value: int | str | None, name: str, what: str = "a size (e.g. 1G, 512M, 1.5g)"
) -> int | None:
    """vLLM's human-readable integers: a lower-case suffix is decimal (1k = 1000), an upper-case
    one binary (1K = 1024), up to g/G."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(value))
    if not m:
        raise ValueError(f"{name} {value!r} is not {what}.")
    number, suffix = float(m.group(1)), m.group(2)
    scale = {"": 1, "k": 1000, "K": 1024, "m": 10**6, "M": 1 << 20, "g": 10**9, "G": 1 << 30}[suffix]
    return int(number * scale)


def as_dict(value: Any, name: str) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}.")
    return value


class G:
    """vLLM's help groups (the config class each flag belongs to in vLLM)."""

    FRONTEND = "Frontend"
    MODEL = "ModelConfig"
    LOAD = "LoadConfig"
    DECODING = "DecodingConfig"
    PARALLEL = "ParallelConfig"
    CACHE = "CacheConfig"
    MM = "MultiModalConfig"
    LORA = "LoRAConfig"
    PA = "PromptAdapterConfig"
    DEVICE = "DeviceConfig"
    SPEC = "SpeculativeConfig"
    OBS = "ObservabilityConfig"
    SCHED = "SchedulerConfig"
    COMP = "CompilationConfig"
    VLLM = "VllmConfig"
    TOKPOOL = "TokenizerPoolConfig"
    VISION = "VisionLanguageConfig"


# vLLM's help groups, in the order `vllm serve --help` shows them (the last two: older releases').
GROUPS = (
    G.FRONTEND, G.MODEL, G.LOAD, G.DECODING, G.PARALLEL, G.CACHE, G.MM, G.LORA, G.PA, G.DEVICE, G.SPEC,
    G.OBS, G.SCHED, G.COMP, G.VLLM, G.TOKPOOL, G.VISION,
)  # fmt: skip
