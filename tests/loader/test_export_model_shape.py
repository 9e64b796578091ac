"""scripts/export_model_shape.py: a GGUF's shape without its weights, served with dummy weights.

What the accelerator check carries instead of the default model's 98 MB file: the directory must
describe the same model (config) and speak the same vocabulary (tokenizer, loaded the way a
Hugging Face directory is), and an engine must serve it with --load-format dummy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxserve.loader.gguf import load_gguf_tokenizer, read_gguf_config

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "export_model_shape.py")
TEXTS = ["Hello world! The capital of France is Paris.", "def f(x):\n\treturn x ** 2  # 12345"]


@pytest.fixture(scope="module")
def shape(tiny_gguf, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("shape") / "tiny-shape")
    done = subprocess.run(
        [sys.executable, SCRIPT, out, "--model", tiny_gguf.path], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return out


def test_the_directory_holds_the_files_config_and_no_weights(shape, tiny_gguf):
    with open(os.path.join(shape, "config.json")) as fh:
        assert json.load(fh) == read_gguf_config(tiny_gguf.path)
    assert not [f for f in os.listdir(shape) if f.endswith((".gguf", ".safetensors", ".bin"))]


def test_the_directory_tokenizes_as_the_gguf_does(shape, tiny_gguf):
    from jaxserve.loader.tokenizer import get_tokenizer

    ours, theirs = get_tokenizer(shape), load_gguf_tokenizer(tiny_gguf.path)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == theirs.decode(ids)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)


def test_an_engine_serves_the_shape_with_dummy_weights(shape, tiny_gguf):
    from jaxserve import LLM, SamplingParams

    llm = LLM(shape, load_format="dummy", max_model_len=64, max_num_seqs=4, enforce_eager=True)
    args = llm.llm_engine.runner.args
    config = tiny_gguf.config
    assert (args.num_layers, args.vocab_size) == (config["num_hidden_layers"], config["vocab_size"])
    [out] = llm.generate(
        [TEXTS[0]], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0), use_tqdm=False
    )
    assert len(out.outputs[0].token_ids) == 5
    assert all(0 <= t < config["vocab_size"] for t in out.outputs[0].token_ids)


def test_a_missing_file_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path / "out"), "--model", str(tmp_path / "none.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "none.gguf" in done.stderr
