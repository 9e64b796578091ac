"""benchmarks/stream_cost.py on short streams: every case streams the tokens asked for (it checks
the usage chunk), and the host time it reports splits into the event loop's and the outputs'."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_every_case_reports_the_host_time_of_both_lengths(tmp_path):
    out = tmp_path / "o.json"
    assert (
        load_benchmark("stream_cost").main(
            ["--short", "8", "--long", "24", "--rounds", "1", "--output-json", str(out)]
        )
        == 0
    )
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == ["chat", "chat+logprobs", "completions", "completions+logprobs"]
    for case in results.values():
        for n in ("8", "24"):
            m = case["us_per_token"][n]
            assert m["loop"] > 0 and m["outputs"] > 0 and abs(m["stream"] - m["loop"] - m["outputs"]) < 1e-6
        assert (
            case["long_over_short"]
            == case["us_per_token"]["24"]["stream"] / case["us_per_token"]["8"]["stream"]
        )
