"""benchmarks/engine_overhead.py on tiny batches: every decode step but the last two is measured,
the parts it reports fit inside the step they were taken from, for the host-alone loop (the decode
program replaced by a stand-in) too."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_decode_steps_are_split_into_host_and_device_time_both_ways(tmp_path, capsys):
    out = tmp_path / "o.json"
    argv = [
        "--batch-sizes",
        "1",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "12",
        "--vocab-size",
        "300",
        "--enforce-eager",
        "--rounds",
        "1",
    ]
    assert (
        load_benchmark("engine_overhead").main([*argv, "--output-json", str(out)]) == 0
    )  # (it checks that the outputs agree)
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["results"]] == [1, 4]
    for r in report["results"]:
        assert r["device_ms"] > 0
        for mode in ("sync", "async"):
            # the first token comes from the prefill; of the 11 decode steps, the last has no successor
            assert r[mode]["decode_steps_measured"] == 10
            m = r[mode]["ms_median"]
            assert 0 < m["wait"] < m["step"] and 0 < m["scheduler"] + m["prepare"] < m["host"]
            assert m["idle_gap"] == max(0.0, m["step"] - r["device_ms"])
        assert (
            r["async_over_sync"]["step"] == r["async"]["ms_median"]["step"] / r["sync"]["ms_median"]["step"]
        )
        alone = r["host_alone"]  # the same decode steps again, with the stand-in program
        assert alone["decode_steps_measured"] == 10 and "idle_gap" not in alone["ms_median"]
        assert (
            0 < alone["ms_median"]["scheduler"] + alone["ms_median"]["prepare"] < alone["ms_median"]["step"]
        )
    assert capsys.readouterr().out.count("ms/step") == 6
