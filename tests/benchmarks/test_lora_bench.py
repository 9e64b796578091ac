"""benchmarks/lora.py on a tiny model: every run is measured against the base engine in the same
rounds; requests on the base model through the LoRA engine give the base model's tokens, and
requests with the benchmark's random adapters do not."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_adapters_against_the_base_engine(tiny_llama_gqa, tmp_path, capsys):
    out = tmp_path / "lora.json"
    argv = ["--model", tiny_llama_gqa[0], "--adapters", "1", "2", "--requests", "4", "--prompt-tokens", "8"]
    argv += ["--tokens", "6", "--rank", "4", "--rounds", "1", "--max-model-len", "128", "--enforce-eager"]
    assert load_benchmark("lora").main([*argv, "--output-json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"base", "lora-0", "lora-1", "lora-2"}
    assert runs["base"]["ratio"] == 1.0 and all(r["tok_s"] > 0 for r in runs.values())
    assert runs["base"]["changed"] == 0 and runs["lora-0"]["changed"] == 0
    assert runs["lora-1"]["changed"] >= 0.5 and runs["lora-2"]["changed"] >= 0.5
    assert capsys.readouterr().out.count("tok/s") == 4
