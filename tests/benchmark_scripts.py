"""The scripts in benchmarks/ as modules, for the tests that run their main() in-process."""

from __future__ import annotations

import importlib.util
import os

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load_benchmark(name: str):
    """benchmarks/<name>.py, imported afresh."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
