"""benchmarks/pacing.py on a tiny model: each round runs the three ways with the same requests,
and only the paced one waits."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_three_ways_per_round_and_only_the_paced_one_waits(tiny_llama_gqa, tmp_path, capsys):
    out = tmp_path / "pacing.json"
    argv = ["--model", tiny_llama_gqa[0], "--clients", "2", "--requests", "2", "--rounds", "1"]
    assert load_benchmark("pacing").main([*argv, "--output-json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["mode"] for r in runs] == ["sync", "paced", "unpaced"]
    for r in runs:
        assert r["output_tok_s"] > 0 and r["mean_ttft_ms"] > 0
    assert runs[0]["waits"] == runs[2]["waits"] == 0
    assert capsys.readouterr().out.count("tok/s") == 3
