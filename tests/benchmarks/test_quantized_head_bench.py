"""benchmarks/quantized_head.py on a small table: every layout gives the float32 head's logits on
the dequantized table (the script checks before timing), on both sides of the served head's
switch from one whole product to vocabulary chunks."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark

from jaxserve.layers import linear


def test_every_layout_agrees_and_is_timed_against_f32(tmp_path):
    out = tmp_path / "head.json"
    vocab = 2 * linear.HEAD_CHUNK_ROWS
    rows = [1, linear.HEAD_WHOLE_MAX_ROWS + 1]
    argv = ["--shape", str(vocab), "64", "--rows", *map(str, rows), "--rounds", "1", "--calls", "1"]
    assert load_benchmark("quantized_head").main([*argv, "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bytes"]["f32"] == vocab * 64 * 4
    assert report["bytes"]["q8-served"] == vocab * 64 + vocab * 2 * 4  # int8 values, a scale per 32
    assert list(report["rows"]) == [str(r) for r in rows]
    for layouts in report["rows"].values():
        assert layouts["f32"]["ratio_to_f32"] == 1.0 and all(r["ms"] > 0 for r in layouts.values())
