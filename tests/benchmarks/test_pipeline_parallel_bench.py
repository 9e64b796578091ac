"""benchmarks/pipeline_parallel.py on a tiny 4-layer model: every configuration gives the base's
tokens and a positive ratio to it, and each one with stages a prefill timeline of its stages and
microbatches (the script sets its own fake devices: a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmark_scripts import BENCHMARKS
from tiny_models import TEST_XLA_FLAGS, TP_LLAMA, make_checkpoint


def test_stages_and_tensor_parallel_give_the_base_tokens(tmp_path):
    model = str(tmp_path / "llama")
    make_checkpoint(
        model, "LlamaConfig", "LlamaForCausalLM", {**TP_LLAMA, "num_hidden_layers": 4}, "float32", 0
    )
    out = tmp_path / "pp.json"
    argv = ["--model", model, "--configs", "1x1", "2x1", "2x2m8", "--batch", "2", "--prompt-len", "16"]
    argv += [
        "--max-tokens",
        "6",
        "--rounds",
        "1",
        "--max-num-batched-tokens",
        "64",
        "--output-json",
        str(out),
    ]
    env = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "pipeline_parallel.py"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert list(rows) == ["1x1", "2x1", "2x2m8"]
    for row in rows.values():
        assert row["same_tokens_as_1x1"] and row["prefill_ratio"] > 0 and row["decode_ratio"] > 0
    # 32 prompt tokens: one batch at the default microbatch size, four of 8 tokens with m8
    for config, micro in (("2x1", 1), ("2x2m8", 4)):
        timeline = rows[config]["prefill_timeline"]
        assert timeline["microbatches"] == micro
        assert [len(stage) for stage in timeline["stages_ms"]] == [micro, micro]
        for stage in timeline["stages_ms"]:
            assert all(0 <= start <= end <= timeline["span_ms"] for start, end in stage)
        assert 0 <= timeline["overlap_ms"] <= timeline["span_ms"]
