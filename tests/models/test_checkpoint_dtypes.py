"""Half-precision checkpoints: they load, and serving them agrees with transformers.

Served in float32 (dtype auto on CPU), a bfloat16 or float16 checkpoint must give the
float32 logits of its own weights within 1e-4. Served in its own dtype, our rounding
differs from torch's, so the bound is relative to torch's own half-precision error: our
distance from the float32 logits may be at most twice torch's (plus a small floor), i.e.
we lose no more precision than the reference implementation does. Gemma 2 rounds
differently from Llama (norms scale in float32 and cast last), so it is checked too.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference_checks import prompt_logits, teacher_forced_logits
from tiny_models import engine_kwargs, make_family_checkpoint, make_llama_checkpoint

from jaxserve.args import EngineArgs
from jaxserve.runner.model_runner import ModelRunner


@pytest.fixture(
    scope="module", params=[("llama", "bfloat16"), ("llama", "float16"), ("gemma2", "bfloat16")], ids="-".join
)
def half_checkpoint(request, tmp_path_factory):
    """(path, dtype, transformers model loaded in that dtype, the same loaded in float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    family, dtype = request.param
    path = tmp_path_factory.mktemp(f"{family}-{dtype}")
    if family == "llama":
        make_llama_checkpoint(path, "gqa", dtype=dtype)
    else:
        make_family_checkpoint(path, family, dtype=dtype)
    half = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return str(path), dtype, half, full


def _runner(path: str, dtype: str) -> ModelRunner:
    return ModelRunner(EngineArgs(model=path, dtype=dtype, **engine_kwargs()).create_engine_config())


def test_half_checkpoint_served_in_float32_matches_its_weights(half_checkpoint):
    path, _, _, torch_f32 = half_checkpoint
    runner = _runner(path, "auto")
    assert runner.config.model_config.dtype == "float32"
    ids = np.random.default_rng(0).integers(3, 500, size=40).tolist()
    np.testing.assert_allclose(
        prompt_logits(runner, ids), teacher_forced_logits(torch_f32, ids), atol=1e-4, rtol=0
    )


def test_half_checkpoint_served_in_its_dtype_is_as_close_as_torch(half_checkpoint):
    path, dtype, torch_half, torch_f32 = half_checkpoint
    runner = _runner(path, dtype)
    assert runner.config.model_config.dtype == dtype
    ids = np.random.default_rng(0).integers(3, 500, size=40).tolist()
    truth = teacher_forced_logits(torch_f32, ids)
    ours = np.abs(prompt_logits(runner, ids).astype(np.float32) - truth).max()
    theirs = np.abs(teacher_forced_logits(torch_half, ids) - truth).max()
    assert ours <= 2 * theirs + 1e-3, f"ours {ours:.4f} vs torch {theirs:.4f}"
    assert theirs > 0  # the comparison is about real rounding, not identical numbers
