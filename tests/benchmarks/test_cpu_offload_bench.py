"""benchmarks/cpu_offload.py on a tiny model: the offloaded engine holds its layer stacks in host
memory and gives the same tokens; both figures are reported as ratios."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_offloaded_and_on_device_give_the_same_tokens(tiny_llama_gqa, tmp_path, capsys):
    out = tmp_path / "offload.json"
    argv = ["--model", tiny_llama_gqa[0], "-q", "", "--tokens", "8", "--prompt-len", "40", "--rounds", "1"]
    assert load_benchmark("cpu_offload").main([*argv, "--enforce-eager", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_tokens"] and report["decode_ratio"] > 0 and report["prefill_ratio"] > 0
    assert (
        report["engines"]["offloaded"]["host_weight_bytes"]
        > 0
        == report["engines"]["on_device"]["host_weight_bytes"]
    )
    assert "offloaded / on device" in capsys.readouterr().out
