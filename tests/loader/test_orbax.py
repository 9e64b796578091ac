"""`jaxserve convert` and --load-format orbax: the converted directory restores the same
parameters (identical logits) from safetensors or GGUF sources, is detected on its own,
and serves text like the original."""

from __future__ import annotations

import numpy as np
import pytest
from reference_checks import prompt_logits
from tiny_checkpoints import write_gguf_from_hf
from tiny_models import engine_kwargs

from jaxserve.args import EngineArgs
from jaxserve.cli import main
from jaxserve.runner.model_runner import ModelRunner


def _logits(model: str, **kw) -> tuple[np.ndarray, str]:
    runner = ModelRunner(EngineArgs(model=model, **engine_kwargs(**kw)).create_engine_config())
    ids = np.random.default_rng(0).integers(3, 500, size=30).tolist()
    return prompt_logits(runner, ids), runner.config.model_config.load_format


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_converted_checkpoint_restores_identical_logits(tiny_llama_gqa, tmp_path, source, capsys):
    path, torch_model = tiny_llama_gqa
    if source == "gguf":
        path = str(tmp_path / "model.gguf")
        write_gguf_from_hf(path, torch_model, "llama")
    out = str(tmp_path / "converted")
    assert main(["convert", path, "--output", out, "--no-use-tqdm-on-load"]) == 0
    assert f"serve {out}" in capsys.readouterr().out
    original, fmt = _logits(path)
    assert fmt == source
    converted, fmt = _logits(out)  # detected, no flag needed
    assert fmt == "orbax"
    np.testing.assert_array_equal(converted, original)
    explicit, _ = _logits(out, load_format="orbax")
    np.testing.assert_array_equal(explicit, original)


def test_converted_directory_serves_text_like_the_original(tiny_llama_gqa, tmp_path):
    from jaxserve import LLM, SamplingParams

    path, _ = tiny_llama_gqa
    out = str(tmp_path / "converted")
    assert main(["convert", path, "--output", out, "--no-use-tqdm-on-load"]) == 0
    params = SamplingParams(temperature=0.0, max_tokens=8)
    texts = [LLM(m, **engine_kwargs()).generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs[0].text
             for m in (path, out)]  # fmt: skip
    assert texts[0] == texts[1]


def test_orbax_format_needs_a_converted_directory(tiny_llama_gqa, tmp_path, capsys):
    with pytest.raises(ValueError, match="jaxserve convert"):
        EngineArgs(model=tiny_llama_gqa[0], load_format="orbax", **engine_kwargs()).create_engine_config()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", tiny_llama_gqa[0], "--output", str(tmp_path / "busy"), "--no-use-tqdm-on-load"])
    assert exit_info.value.code == 2
    assert "not empty" in capsys.readouterr().err
