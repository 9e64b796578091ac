"""How long `jaxserve serve` takes to become useful, cold and warm.

Why it exists: start-up is what a user pays before the first token (and what every test
that starts a server pays), and it is spent far from the request path that the serving
benchmarks measure. This script launches the real command line as a subprocess, exactly
as a user would, and times two moments from process start:

  health       the first HTTP 200 on /health (weights loaded, KV pool allocated, every
               bucket compiled, socket bound)
  first token  the first streamed token of a chat completion sent right after that

A cold run points XDG_CACHE_HOME (jaxserve_cache_dir's root) at a fresh directory holding
only a link to the downloaded models/, so the XLA compilation cache and the converted
tokenizer are rebuilt while the default model still resolves to its usual path; a warm run
is the next start on that same directory. `jaxserve --help` and `jaxserve serve --help`
are timed too. The server's own log (weights, KV pool, compile, bind) is kept per run as
a timeline relative to process start.

    python benchmarks/startup.py --label before --runs 3
    python benchmarks/startup.py --serve-args "--max-model-len 2048 --max-num-seqs 16"

Writes benchmarks/results/startup-<label>.json and prints a table of medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from importlib import metadata

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Server log lines worth a point on the timeline: name -> regex (group 1, if any, is the
# duration the server itself reports for that stage).
LOG_EVENTS = {
    "weights_loaded": r"Loaded weights in ([\d.]+) s",
    "kv_pool_allocated": r"KV cache: \d+ blocks",
    "buckets_compiled": r"Compiled \d+ step buckets in ([\d.]+) s",
    "serving": r"Serving .* on ",
}
LOG_TIME = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def jaxserve_command() -> list[str]:
    """The venv's console script if installed beside this interpreter, else the module form."""
    script = shutil.which("jaxserve", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "jaxserve.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def models_dir() -> str:
    """Where the default model was downloaded (jaxserve.config.jaxserve_cache_dir("models"))."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxserve", "models")


def fresh_cache_root() -> str:
    """An empty cache root whose jaxserve/models links to the real one."""
    root = tempfile.mkdtemp(prefix="jaxserve-startup-")
    os.makedirs(os.path.join(root, "jaxserve"))
    os.symlink(models_dir(), os.path.join(root, "jaxserve", "models"))
    return root


def time_command(argv: list[str], source: str | None) -> float:
    start = time.perf_counter()
    subprocess.run(
        argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env(source)
    )
    return time.perf_counter() - start


def wait_healthy(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before /health was 200")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise TimeoutError("/health did not answer 200 in time")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (a clean shutdown), then a kill if it has not exited within a minute."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def first_token(base: str, timeout: float) -> tuple[float, float]:
    """Stream a short greedy chat completion to its end; (perf_counter() when the first
    content arrived, seconds from sending to it)."""
    body = {
        "messages": [{"role": "user", "content": "Say hello."}],
        "stream": True,
        "max_tokens": 8,
        "temperature": 0,
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start, first = time.perf_counter(), None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or [{}]
            if first is None and choices[0].get("delta", {}).get("content"):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the streamed completion carried no content")
    return start + first, first


def log_timeline(log: str, started_at: float) -> dict:
    """Seconds from process start at which each LOG_EVENTS line was written, plus the
    durations the server reported itself (<event>_reported_s)."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        stamp = LOG_TIME.match(line)
        for name, pattern in LOG_EVENTS.items():
            m = re.search(pattern, line)
            if stamp is None or m is None or name in out:
                continue
            when = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out[name] = round(when - started_at, 3)
            if m.groups():
                out[name + "_reported_s"] = float(m.group(1))
    return out


def child_env(source: str | None, **extra: str) -> dict:
    """The environment of a jaxserve subprocess; `source` puts another copy of the package
    (an exported older commit, say) ahead of the installed one."""
    env = dict(os.environ, **extra)
    if source:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    return env


def run_server(
    cache_root: str, serve_args: list[str], timeout: float, log_path: str, source: str | None
) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [*jaxserve_command(), "serve", "--port", str(port), *serve_args]
    env = child_env(source, XDG_CACHE_HOME=cache_root)
    load = os.getloadavg()[0]
    with open(log_path, "w") as log:
        started_at, start = time.time(), time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(base + "/health", proc, start + timeout)
            health = time.perf_counter() - start
            first_at, ttft = first_token(base, timeout)
            token = first_at - start
        finally:
            stop_server(proc)
    with open(log_path) as f:
        text = f.read()
    return {
        "health_s": round(health, 3),
        "first_token_s": round(token, 3),
        "request_ttft_s": round(ttft, 3),
        "exit_status": proc.returncode,
        "loadavg_1m_at_start": round(load, 2),  # another job on the machine skews everything
        "log": log_timeline(text, started_at),
    }


def median_of(runs: list[dict]) -> dict:
    keys = sorted(
        {k for r in runs for k, v in r.items() if isinstance(v, (int, float)) and k != "exit_status"}
    )
    med = {k: round(statistics.median(r[k] for r in runs if k in r), 3) for k in keys}
    logs = [r["log"] for r in runs if "log" in r]
    if logs:
        names = sorted({k for lg in logs for k in lg})
        med["log"] = {k: round(statistics.median(lg[k] for lg in logs if k in lg), 3) for k in names}
    return med


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--runs", type=int, default=3, help="Runs of each measurement (the median is reported).")
    p.add_argument("--label", default="current", help="Names the result file startup-<label>.json.")
    p.add_argument(
        "--serve-args", default="", help='Extra `jaxserve serve` flags, e.g. "--max-model-len 2048".'
    )
    p.add_argument("--timeout", type=float, default=900, help="Seconds one server may take to answer.")
    p.add_argument("--no-help", action="store_true", help="Skip timing the --help commands.")
    p.add_argument("--no-warm", action="store_true", help="Cold runs only.")
    p.add_argument(
        "--source",
        default=None,
        metavar="DIR",
        help="Directory holding another jaxserve/ package to run instead (e.g. `git archive` of a "
        "commit); it goes first on PYTHONPATH, ahead of the installed (editable) package.",
    )
    p.add_argument("--keep", action="store_true", help="Keep the cache directories and server logs.")
    args = p.parse_args()
    serve_args = shlex.split(args.serve_args)
    args.source = os.path.abspath(args.source) if args.source else None
    cmd = jaxserve_command()

    runs: dict[str, list] = {"help": [], "serve_help": [], "cold": [], "warm": []}
    for i in range(args.runs):
        if not args.no_help:
            runs["help"].append({"wall_s": round(time_command([*cmd, "--help"], args.source), 3)})
            runs["serve_help"].append(
                {"wall_s": round(time_command([*cmd, "serve", "--help"], args.source), 3)}
            )
        root = fresh_cache_root()
        try:
            for kind in ("cold", "warm")[: 1 if args.no_warm else 2]:
                log_path = os.path.join(root, f"server-{kind}.log")
                result = run_server(root, serve_args, args.timeout, log_path, args.source)
                runs[kind].append(result)
                print(f"run {i + 1}/{args.runs} {kind}: health {result['health_s']:.1f} s, "
                      f"first token {result['first_token_s']:.1f} s  {result['log']}", flush=True)  # fmt: skip
        finally:
            if args.keep:
                print(f"kept {root}", flush=True)
            else:
                shutil.rmtree(root, ignore_errors=True)

    runs = {k: v for k, v in runs.items() if v}
    report = {
        "label": args.label,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": [os.path.basename(cmd[0]), *cmd[1:], "serve", *serve_args],
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "versions": {pkg: _version(pkg) for pkg in ("jaxserve", "jax", "jaxlib", "flax", "transformers")},
        "git_commit": _git_commit(args.source),
        "source": args.source,
        "runs": runs,
        "median": {k: median_of(v) for k, v in runs.items()},
    }
    os.makedirs(RESULTS, exist_ok=True)
    out = os.path.join(RESULTS, f"startup-{args.label}.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print_table(report)
    print(f"wrote {out}")
    return 0


def print_table(report: dict) -> None:
    rows = [("jaxserve --help", "help", "wall_s"), ("jaxserve serve --help", "serve_help", "wall_s")]
    for kind in ("cold", "warm"):
        rows += [(f"{kind}: /health 200", kind, "health_s"), (f"{kind}: first token", kind, "first_token_s")]
    print(f"\n{'(seconds from process start)':<28}{'median':>8}   runs")
    for title, kind, key in rows:
        if kind in report["runs"]:
            values = " ".join(f"{r[key]:.2f}" for r in report["runs"][kind])
            print(f"{title:<28}{report['median'][kind][key]:>8.2f}   {values}")
    for kind in ("cold", "warm"):
        log = report["median"].get(kind, {}).get("log")
        if log:
            marks = ", ".join(f"{k} {v:.1f}" for k, v in log.items() if not k.endswith("_reported_s"))
            print(f"{kind} server log (s from start, median): {marks}")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _git_commit(source: str | None) -> str | None:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=source or os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
