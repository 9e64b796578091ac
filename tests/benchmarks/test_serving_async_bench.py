"""benchmarks/serving_async.py with its servers and `jaxserve bench serve` replaced by fakes: the
rounds alternate which mode goes first, and the ratios are those of the rounds' means."""

from __future__ import annotations

import json

from benchmark_scripts import BENCHMARKS, load_benchmark


def test_rounds_alternate_and_ratios_come_from_the_means(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(BENCHMARKS)  # it imports its neighbour startup.py
    module = load_benchmark("serving_async")
    calls = []
    # output tok/s of the timed calls in turn: round 0 sync then async, round 1 async then sync
    throughput = iter([100.0, 110.0, 90.0, 120.0])

    def fake_bench(base, concurrency, ns, result_dir, name):
        calls.append((base, concurrency, name))
        tok_s = 1.0 if name.startswith("warmup") else next(throughput)
        return {k: tok_s for k in module.REPORTED} | {"mean_ttft_ms": 1000.0 / tok_s}

    def fake_server(mode, serve_args, log_dir):
        return None, f"http://{mode}", open(tmp_path / f"{mode}.log", "w")

    monkeypatch.setattr(module, "start_server", fake_server)
    monkeypatch.setattr(module, "wait_healthy", lambda *args: None)
    monkeypatch.setattr(module, "stop_server", lambda proc: None)
    monkeypatch.setattr(module, "bench", fake_bench)
    out = tmp_path / "summary.json"
    argv = ["--concurrency", "8", "--rounds", "2", "--result-dir", str(tmp_path), "--output-json", str(out)]
    assert module.main(argv) == 0
    assert [(base, name) for base, _, name in calls] == [
        ("http://sync", "warmup-sync.json"),
        ("http://async", "warmup-async.json"),
        ("http://sync", "serving_async_sync_c8_r0.json"),
        ("http://async", "serving_async_async_c8_r0.json"),
        ("http://async", "serving_async_async_c8_r1.json"),
        ("http://sync", "serving_async_sync_c8_r1.json"),
    ]
    row = json.loads(out.read_text())["results"][0]
    # sync's rounds 100 and 120 tok/s, async's 110 and 90: means 110 and 100
    assert row["async_over_sync"]["output_throughput"] == 100.0 / 110.0
    assert row["round_ratios"]["output_throughput"] == [1.1, 0.75]
    assert row["sync"]["mean_ttft_ms"] == (10.0 + 1000.0 / 120.0) / 2
    assert "0.909x" in capsys.readouterr().out
