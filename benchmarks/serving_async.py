"""Serving with synchronous against asynchronous scheduling, in one sitting.

Two `jaxserve serve` processes on the same model and flags, one with `--no-async-scheduling` and
one with `--async-scheduling`, both up for the whole run; `jaxserve bench serve` then measures
each concurrency on one server and right after on the other (random prompts, EOS ignored, every
request at once behind --max-concurrency), so a noisy machine weighs on both alike. With
--rounds N each concurrency is measured N times, the mode that goes first alternating, and the
ratios come from the rounds' sums (each round's ratio is kept too: their spread is the noise). Each
benchmark's result JSON is kept, and a summary with the async/sync ratios of output tok/s and
TTFT.

    python benchmarks/serving_async.py [--concurrency 1 8 32] [--rounds 1] [--output-json FILE]
        [-- serve flags]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from startup import free_port, jaxserve_command, stop_server, wait_healthy

MODES = {"sync": "--no-async-scheduling", "async": "--async-scheduling"}
REPORTED = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/serving_async.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--prompts-per-slot", type=int, default=2, help="Requests per concurrency slot (at least 8 in all)."
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="Measurements per concurrency and mode, alternating which goes first.",
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--result-dir", default=None, help="Where each benchmark's JSON goes; default: a temp dir."
    )
    parser.add_argument("--output-json", default=None, help="The summary.")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="Seconds for a server to become healthy."
    )
    parser.add_argument("serve_args", nargs="*", help="Flags for both servers (after --).")
    return parser


def start_server(mode: str, serve_args: list[str], log_dir: str) -> tuple[subprocess.Popen, str, object]:
    port = free_port()
    log = open(os.path.join(log_dir, f"server-{mode}.log"), "w")
    argv = [*jaxserve_command(), "serve", "--port", str(port), MODES[mode], *serve_args]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}", log


def bench(base: str, concurrency: int, ns, result_dir: str, name: str) -> dict:
    argv = [
        *jaxserve_command(), "bench", "serve", "--backend", "openai", "--base-url", base,
        "--dataset-name", "random", "--random-input-len", str(ns.input_len),
        "--random-output-len", str(ns.output_len), "--ignore-eos", "--request-rate", "inf",
        "--max-concurrency", str(concurrency), "--num-prompts", str(max(8, concurrency * ns.prompts_per_slot)),
        "--save-result", "--result-dir", result_dir, "--result-filename", name, "--disable-tqdm",
    ]  # fmt: skip
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(result_dir, name)) as fh:
        return json.load(fh)


def summarize(concurrency: int, runs: dict[str, list[dict]]) -> dict:
    """One concurrency's rounds: each mode's means, the ratio of the means and each round's ratio."""
    row: dict = {"concurrency": concurrency, "rounds": len(runs["sync"])}
    for mode, found in runs.items():
        row[mode] = {k: sum(r[k] for r in found) / len(found) for k in REPORTED}
        row[f"{mode}_rounds"] = found
    row["async_over_sync"] = {k: row["async"][k] / row["sync"][k] for k in REPORTED}
    row["round_ratios"] = {
        k: [a[k] / s[k] for s, a in zip(runs["sync"], runs["async"], strict=True)] for k in REPORTED
    }
    return row


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="jaxserve-serving-async-")
    result_dir = ns.result_dir or log_dir
    servers = {mode: start_server(mode, ns.serve_args, log_dir) for mode in MODES}
    try:
        for proc, base, _ in servers.values():
            wait_healthy(base + "/health", proc, time.perf_counter() + ns.timeout)
        # a first small round on each: every step shape this load needs is compiled before timing
        for mode, (_, base, _) in servers.items():
            bench(base, max(ns.concurrency), ns, log_dir, f"warmup-{mode}.json")
        rows = []
        for c in ns.concurrency:
            runs = {mode: [] for mode in MODES}
            for round_ in range(ns.rounds):
                for mode in MODES if round_ % 2 == 0 else reversed(MODES):
                    name = f"serving_async_{mode}_c{c}" + (f"_r{round_}" if ns.rounds > 1 else "")
                    result = bench(servers[mode][1], c, ns, result_dir, name + ".json")
                    runs[mode].append({k: result[k] for k in REPORTED})
            rows.append(summarize(c, runs))
            row, r = rows[-1], rows[-1]["async_over_sync"]
            print(
                f"concurrency {c:3d}: output tok/s sync {row['sync']['output_throughput']:.1f}, async "
                f"{row['async']['output_throughput']:.1f} ({r['output_throughput']:.3f}x, rounds "
                f"{', '.join(f'{x:.2f}' for x in row['round_ratios']['output_throughput'])}); mean TTFT "
                f"sync {row['sync']['mean_ttft_ms']:.0f} ms, async {row['async']['mean_ttft_ms']:.0f} ms "
                f"({r['mean_ttft_ms']:.3f}x, rounds {', '.join(f'{x:.2f}' for x in row['round_ratios']['mean_ttft_ms'])})"
            )
    finally:
        for proc, _, log in servers.values():
            stop_server(proc)
            log.close()
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            config = {**vars(ns), "cpu_count": os.cpu_count()}
            json.dump({"config": config, "results": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
