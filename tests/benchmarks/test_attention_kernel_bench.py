"""benchmarks/attention_kernel.py on CPU with the reference backend and tiny shapes: the report's
numbers follow from the shapes, and a kernel the platform lacks exits 2 in one line."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark

TINY = ["--num-seqs", "3", "--context-len", "40", "--prefill-len", "9", "--num-prefills", "1"]
TINY += ["--num-q-heads", "4", "--num-kv-heads", "2", "--head-dim", "64", "--page-size", "16"]
TINY += ["--dtype", "float32", "--iters", "2"]


def test_report_counts_the_kv_every_sequence_reads(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert (
        load_benchmark("attention_kernel").main(
            ["--backend", "reference", *TINY, "--peak-gbps", "100", "--output-json", str(out)]
        )
        == 0
    )
    report = json.loads(out.read_text())
    per_token = 2 * 2 * 64 * 4  # k and v, 2 kv heads, head_dim 64, float32
    decode, mixed = report["results"]["decode"], report["results"]["mixed"]
    assert decode["kv_bytes"] == 3 * 41 * per_token and decode["tokens"] == 3
    assert mixed["kv_bytes"] == (49 + 2 * 41) * per_token and mixed["tokens"] == 9 + 2
    for row in (decode, mixed):
        assert row["seconds"] > 0
        assert row["share_of_peak_bandwidth"] == row["kv_gbps"] / 100
    assert report["config"]["backend_traced"] == "reference"
    assert capsys.readouterr().out.count("per call") == 2


def test_a_kernel_the_platform_lacks_exits_2(capsys):
    assert load_benchmark("attention_kernel").main(["--backend", "pallas", *TINY]) == 2
    assert "needs a TPU or GPU" in capsys.readouterr().err
