"""Compiled steps stored on disk load at the next start without tracing and give the same tokens.

A second engine on the same cache directory must not trace a single step (tracing is patched to
fail), a changed shape must miss, a damaged entry must be compiled again, and a tensor-parallel
step must load onto its own devices.
"""

from __future__ import annotations

import glob
import os
import textwrap

import jax
import numpy as np
import pytest
from tiny_models import engine_kwargs, run_on_fake_devices

from jaxserve import LLM, SamplingParams
from jaxserve.runner import model_runner, step_programs

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 500, size=n).tolist() for n in (3, 30)]


@pytest.fixture(autouse=True)
def own_step_caches(monkeypatch):
    """Each engine's runner with a StepCache of its own, as in a new process: every step comes
    from the store on disk or from a compile, never from an earlier engine's memory (the tests'
    shared cache, conftest.py's step_cache, is set aside)."""
    from jaxserve.engine import llm_engine
    from jaxserve.sharding import make_mesh

    def build_runner(config, devices=None):
        mesh = make_mesh(config.parallel_config.tensor_parallel_size, devices=devices)
        return model_runner.ModelRunner(config, mesh, step_cache=None)

    monkeypatch.setattr(llm_engine, "build_runner", build_runner)


def run(path: str, cache_dir: str, prompts, **overrides) -> list[list[int]]:
    kwargs = engine_kwargs(**overrides)
    kwargs["compilation_config"] = {**kwargs["compilation_config"], "cache_dir": cache_dir}
    llm = LLM(path, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture
def no_tracing(monkeypatch):
    def refuse(self, *args):
        raise AssertionError("a step was traced although it was stored")

    monkeypatch.setattr(step_programs.StepPrograms, "_trace_and_compile", refuse)


def stored(cache_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(cache_dir, "jaxserve-steps", "*.pkl")))


def test_a_second_start_loads_every_step_and_gives_the_same_tokens(
    tiny_llama_gqa, prompts, tmp_path, request
):
    path, _ = tiny_llama_gqa
    cache = str(tmp_path)
    first = run(path, cache, prompts)
    entries = stored(cache)
    assert len(entries) == 2  # the decode and the prefill bucket this workload used
    request.getfixturevalue("no_tracing")
    assert run(path, cache, prompts) == first
    assert stored(cache) == entries
    # the store replaces JAX's cache on CPU: an executable XLA:CPU read from that cache does not
    # survive a second serialization (it fails at run time), so none may be stored
    assert jax.config.jax_compilation_cache_dir is None


def test_a_changed_shape_misses_and_a_damaged_entry_is_compiled_again(tiny_llama_gqa, prompts, tmp_path):
    path, _ = tiny_llama_gqa
    cache = str(tmp_path)
    first = run(path, cache, prompts)
    entries = stored(cache)
    assert run(path, cache, prompts, max_num_seqs=4) == first  # other shapes: other entries
    assert len(stored(cache)) == 2 * len(entries)
    for entry in entries:
        with open(entry, "wb") as fh:
            fh.write(b"not an executable")
    assert run(path, cache, prompts) == first
    assert all(os.path.getsize(e) > 1000 for e in entries)  # stored again, whole


TP_SCRIPT = textwrap.dedent(
    """
    import sys
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner import step_programs
    from tiny_models import engine_kwargs

    path, cache, mode = sys.argv[1:4]
    if mode == "load":
        def refuse(self, *args):
            raise AssertionError("traced")
        step_programs.StepPrograms._trace_and_compile = refuse
    kwargs = engine_kwargs(tensor_parallel_size=2)
    kwargs["compilation_config"] = {**kwargs["compilation_config"], "cache_dir": cache}
    out = LLM(path, **kwargs).generate(
        [{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    print(list(out[0].outputs[0].token_ids))
    """
)


def test_a_tensor_parallel_step_loads_onto_its_devices(tiny_llama_gqa, tmp_path):
    path, _ = tiny_llama_gqa
    compiled = run_on_fake_devices(TP_SCRIPT, path, str(tmp_path), "compile", devices=2)
    assert stored(str(tmp_path))
    assert run_on_fake_devices(TP_SCRIPT, path, str(tmp_path), "load", devices=2) == compiled
