"""The package's imports point one way: entry points -> engine -> runner -> models/layers ->
kernels, with config, sampling params and the host/device contract at the bottom (DESIGN.md,
"Layers"). Every import is read from the source, at module level and inside functions alike, so
an import moved into a function to dodge a circle still counts."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Highest first. A module may import from its own layer or any layer below it. Listed once here
# and mirrored in DESIGN.md. A module is placed by the longest prefix that names it; the bare
# package name stands for `jaxserve/__init__.py` alone.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("jaxserve.cli", "jaxserve.benchmarks", "jaxserve.entrypoints"),
    # the offline API, the package itself and the deviceless TPU compile check
    ("jaxserve", "jaxserve.llm", "jaxserve.metrics", "jaxserve.aot"),
    ("jaxserve.args", "jaxserve.args_to_config", "jaxserve.args_fields", "jaxserve.model_resolution",
     "jaxserve.pooler_resolution", "jaxserve.flags"),
    ("jaxserve.engine", "jaxserve.structured_output"),
    ("jaxserve.runner", "jaxserve.distributed", "jaxserve.spec_decode.draft_model"),  # a draft runs a runner
    ("jaxserve.loader", "jaxserve.lora"),  # LoRA adapters are read like checkpoints
    ("jaxserve.models",),
    ("jaxserve.layers", "jaxserve.sharding"),
    ("pallas_kernels",),
    ("jaxserve.config", "jaxserve.chips", "jaxserve.sampling_params", "jaxserve.scheduler_output", "jaxserve.outputs",
     "jaxserve.beam_search", "jaxserve.reasoning", "jaxserve.spec_decode", "jaxserve.pooling_params",
     "jaxserve.prompt_embeds", "jaxserve.multimodal"),
)  # fmt: skip


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in ("jaxserve", "pallas_kernels"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            below = module.startswith(prefix + ".") and prefix != "jaxserve"
            if (module == prefix or below) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (and DESIGN.md)")
    return best


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """The package modules `module` imports anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # `import a.b.c` of a non-module attribute
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_from_a_higher_layer(module):
    upward = sorted(i for i in GRAPH[module] if _layer(i) < _layer(module))
    assert not upward, f"{module} (layer {_layer(module)}) imports from higher layers: {upward}"


def test_no_import_circles():
    """Depth-first search for a back edge; the message names the whole circle."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                circle = path[path.index(target) :] + [target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_the_checks_see_function_level_imports():
    """A guard on the guard: the runner's lazy import of the step channel is seen."""
    assert "jaxserve.distributed" in GRAPH["jaxserve.runner.model_runner"]
