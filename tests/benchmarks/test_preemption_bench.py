"""benchmarks/preemption.py on a tiny model: both modes preempt on the small pool, swap copies
pages out instead of recomputing, and every run gives the same tokens."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_swap_and_recompute_give_the_same_tokens(tiny_llama_gqa, tmp_path, capsys):
    out = tmp_path / "preemption.json"
    argv = [
        "--model",
        tiny_llama_gqa[0],
        "--requests",
        "6",
        "--prompt-len",
        "80",
        "--tokens",
        "40",
        "--rounds",
        "1",
    ]
    argv += ["--swap-min-tokens", "16", "--enforce-eager", "--output-json", str(out)]
    assert load_benchmark("preemption").main(argv) == 0
    report = json.loads(out.read_text())
    recompute, swap = report["modes"]["recompute"], report["modes"]["swap"]
    assert recompute["same_tokens"] and swap["same_tokens"]
    assert recompute["preemptions_per_run"][0] > 0 and recompute["swap_outs_per_run"] == [0]
    assert swap["swap_outs_per_run"][0] > 0 and swap["swap_out_bytes"] > 0
    assert report["swap_over_recompute"] > 0 and "swap / recompute" in capsys.readouterr().out
