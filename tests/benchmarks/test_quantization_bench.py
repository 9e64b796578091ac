"""benchmarks/quantization.py on a tiny model: every method is measured against the first in the
same run, and the int8 weights take less memory (an int8 KV cache holds more tokens) while scoring
the text about as well."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_int8_against_float_on_memory_accuracy_and_speed(tiny_llama_gqa, tmp_path, capsys):
    out = tmp_path / "quantization.json"
    argv = ["--model", tiny_llama_gqa[0], "--methods", "none", "int8", "kv-int8", "--batches", "1"]
    argv += [
        "--tokens",
        "4",
        "--rounds",
        "1",
        "--text-tokens",
        "48",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--output-json",
        str(out),
    ]
    assert load_benchmark("quantization").main(argv) == 0
    report = json.loads(out.read_text())
    none, int8 = report["methods"]["none"], report["methods"]["int8"]
    assert (
        none["weight_bytes_ratio"] == 1.0
        and none["perplexity_ratio"] == 1.0
        and none["top1_agreement"] == 1.0
    )
    # a tiny model's embeddings (kept in float32) are most of it; its layers shrink 4x
    assert 0.4 < int8["weight_bytes_ratio"] < 0.75
    assert abs(int8["perplexity_ratio"] - 1) < 0.05 and int8["top1_agreement"] > 0.8
    assert report["text_tokens"] == 48
    kv = report["methods"]["kv-int8"]  # float32 weights, int8 KV pages: 4x the tokens
    assert kv["kv_tokens_ratio"] == 4.0 and int8["kv_tokens_ratio"] == 1.0 and kv["weight_bytes_ratio"] == 1.0
    assert abs(kv["perplexity_ratio"] - 1) < 0.05 and kv["top1_agreement"] > 0.8
    for r in (none, int8):
        assert set(r["decode"]) == {"1"} and all(d["tok_s"] > 0 for d in r["decode"].values())
    assert capsys.readouterr().out.count("tok/s") == 3
