"""benchmarks/quantized_matmul.py on small shapes: every layout computes f32's product on its own
dequantized weights (the script checks before timing) and stores what its name says."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_every_layout_agrees_and_is_timed_against_f32(tmp_path):
    out = tmp_path / "matmul.json"
    argv = ["--layers", "2", "--shape", "64", "128", "--batches", "1", "3", "--rounds", "1", "--calls", "1"]
    assert load_benchmark("quantized_matmul").main([*argv, "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    stored = report["bytes_per_weight"]
    assert stored["f32"] == 4.0 and stored["int8"] == stored["fp8"] == 1 + 4 / 64
    assert stored["packed-2dots"] == stored["packed-concat"] == 0.5 + 2 * 4 / 32  # two nibbles a byte
    assert stored["u8-groups"] == 1 + 2 * 4 / 32
    for rows in report["batches"].values():
        assert rows["f32"]["ratio_to_f32"] == 1.0 and set(rows) == set(stored)
        assert all(r["ms"] > 0 for r in rows.values())
