"""benchmarks/sleep_mode.py on a tiny model: each level frees most of the device memory the
engine holds (weights and KV pool; the small per-request buffers stay) and wakes to the same
greedy tokens."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_each_level_frees_the_weights_and_cache_and_wakes_the_same(tiny_llama_gqa, tmp_path, capsys):
    out = tmp_path / "sleep.json"
    argv = ["--model", tiny_llama_gqa[0], "--rounds", "1", "--tokens", "4", "--max-model-len", "128"]
    assert load_benchmark("sleep_mode").main([*argv, "--enforce-eager", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["levels"]) == {"1", "2"}
    for level in report["levels"].values():
        assert level["same"] and level["freed_fraction"] > 0.5
        assert level["sleep_s"] > 0 and level["wake_s"] > 0
    assert capsys.readouterr().out.count("the same") == 2
