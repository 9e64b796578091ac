"""Pallas interpret-mode executables run Python callbacks; keep them out of the persistent
compilation cache that the rest of the test run shares (a full run that cached them
aborted later inside XLA's cache reads and writes)."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(autouse=True)
def _no_persistent_cache_for_interpreted_kernels(request):
    if request.module.__name__.rsplit(".", 1)[-1] not in (
        "test_tpu_kernel",
        "test_gpu_kernel",
        "test_engine_backends",
    ):
        yield
        return
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
