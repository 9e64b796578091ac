"""Every model shape x TPU chip x tensor parallel size x weight/KV dtype through
`jaxserve tpu-compile-check`, and the tables made from the results.

Each cell is one run of the command (a subprocess: libtpu compiles on this host, nothing runs) that
writes its JSON report into --output-dir; a cell whose report is there already is not run again,
so a long matrix resumes. `--tables` then writes one Markdown file from every report there: which
cells compiled and fit (or why not), the memory per chip, and the projected throughput of the
tpu-inference CI's benchmark shapes next to the gates that CI holds them to.

    python benchmarks/tpu_compile_matrix.py --set gates            # tpu-inference's CI shapes
    python benchmarks/tpu_compile_matrix.py --set matrix --jobs 2  # the whole matrix
    python benchmarks/tpu_compile_matrix.py --tables               # the Markdown from the reports

Time on a 2-core VM (--programs quick: two programs a cell): about half a minute a cell; --programs
default (every bucket, and every variant at the smallest and largest) about 10 s a program.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = os.path.join(ROOT, "configs", "model-shapes")
DEFAULT_DIR = os.path.join(ROOT, "benchmarks", "results", "tpu_compile")
GiB = 2**30


@dataclass(frozen=True)
class Cell:
    name: str
    model: str | None  # a directory under configs/model-shapes; None: the default model
    topology: str
    tp: int
    flags: tuple[str, ...] = ()
    programs: str = "quick"

    def command(self, output: str) -> list[str]:
        model = [] if self.model is None else ["--model", os.path.join(SHAPES, self.model)]
        return [
            sys.executable, "-m", "jaxserve.cli", "tpu-compile-check", *model, "--topology", self.topology,
            "-tp", str(self.tp), "--programs", self.programs, *self.flags, "--json", output,
        ]  # fmt: skip


# tpu-inference's CI serving gates (.buildkite/models/*.yml, read at commit b8692ff of
# vllm-project/tpu-inference): sonnet prompts of 1800 tokens, 128 out, 1000 prompts at an
# unlimited rate, gated on request throughput (req/s) and run as soft failures.
GATES = {
    "Llama-3.1-8B-Instruct": ("v6e-1", 1, 256, 1024, 10.77),
    "Qwen3-4B": ("v6e-1", 1, 94, 4096, 11.00),
    "Llama-3.3-70B-Instruct": ("v6e-8", 8, 256, 4096, 7.0),
    "Qwen3-32B": ("v6e-8", 8, 512, 4096, 12.46),
    "Qwen3-30B-A3B": ("v6e-8", 8, 94, 1024, 7.20),
}
DTYPES = {  # weights / KV pool
    "bf16/bf16": (),
    "int8/bf16": ("-q", "int8"),
    "bf16/fp8": ("--kv-cache-dtype", "fp8"),
    "int8/int8": ("-q", "int8", "--kv-cache-dtype", "int8"),
}
TOPOLOGIES = {1: ("v5e-1", "v6e-1", "v5p-8"), 8: ("v5e-8", "v6e-8", "v5p-16")}
# The default model's 9 query heads (3 KV heads) split over 3 devices, not 8: its multi-chip cells.
DEFAULT_SPLIT = (3, ("v5e-4", "v6e-4", "v5p-8"))
# Every bucket, and every sampler / structured-output variant (--programs default), for one cell
# of each chip generation, weight and KV dtype and tensor parallel size.
FULL = [
    (None, "v6e-1", 1, "bf16/bf16"),
    (None, "v5e-4", 3, "bf16/fp8"),
    ("Llama-3.1-8B-Instruct", "v6e-1", 1, "int8/int8"),
    ("Qwen3-8B", "v5e-1", 1, "int8/bf16"),
    ("Qwen3-30B-A3B", "v6e-8", 8, "bf16/fp8"),
    ("Llama-3.3-70B-Instruct", "v5p-16", 8, "int8/int8"),
]


def gate_cells() -> list[Cell]:
    cells = []
    for model, (topology, tp, seqs, batched, _) in GATES.items():
        flags = (
            "--max-num-seqs",
            str(seqs),
            "--max-model-len",
            "2048",
            "--max-num-batched-tokens",
            str(batched),
        )
        cells.append(Cell(f"gate_{model}_{topology}", model, topology, tp, flags, programs="plain"))
    return cells


def full_cells() -> list[Cell]:
    cells = []
    for model, topology, tp, dtypes in FULL:
        name = f"full_{model or 'default'}_{topology}_tp{tp}_{dtypes.replace('/', '-')}"
        flags = ("--max-model-len", "2048", *DTYPES[dtypes])
        cells.append(Cell(name, model, topology, tp, flags, programs="default"))
    return cells


def matrix_cells(programs: str) -> list[Cell]:
    cells = []
    tp, topologies = DEFAULT_SPLIT
    for topology in topologies:
        for kv in ("bf16/bf16", "bf16/fp8"):
            flags = ("--max-model-len", "2048", *DTYPES[kv])
            cells.append(
                Cell(f"default_{topology}_tp{tp}_{kv.replace('/', '-')}", None, topology, tp, flags, programs)
            )
    for tp, topologies in TOPOLOGIES.items():
        for topology in topologies:
            for kv in ("bf16/bf16", "bf16/fp8"):  # the default model's weights stay GGUF 4-bit
                flags = ("--max-model-len", "2048", *DTYPES[kv])
                cells.append(
                    Cell(
                        f"default_{topology}_tp{tp}_{kv.replace('/', '-')}",
                        None,
                        topology,
                        tp,
                        flags,
                        programs,
                    )
                )
            models = ["Llama-3.1-8B-Instruct", "Qwen3-8B", "Qwen3-30B-A3B"] + (
                ["Llama-3.3-70B-Instruct"] if tp > 1 else []
            )
            for model in models:
                for dtypes, extra in DTYPES.items():
                    name = f"{model}_{topology}_tp{tp}_{dtypes.replace('/', '-')}"
                    cells.append(
                        Cell(name, model, topology, tp, ("--max-model-len", "2048", *extra), programs)
                    )
    return cells  # fmt: skip


def run_cell(cell: Cell, output_dir: str) -> str:
    output = os.path.join(output_dir, f"{cell.name}.json")
    if os.path.exists(output):
        with open(output) as fh:
            if not json.load(fh).get("crashed"):  # a crash (a usage error, libtpu) runs again
                return f"{cell.name}: done before"
    start = time.perf_counter()
    done = subprocess.run(
        cell.command(output), capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
    seconds = time.perf_counter() - start
    if not os.path.exists(output):  # the command itself failed (a usage error, a crash)
        with open(output, "w") as fh:
            json.dump(
                {"cell": cell.name, "crashed": done.stderr.strip().splitlines()[-1:], "seconds": seconds}, fh
            )
    with open(output) as fh:
        report = json.load(fh)
    report.update(cell=cell.name, flags=list(cell.flags), exit_code=done.returncode)
    report["failure_lines"] = [
        line for line in done.stderr.splitlines() if cell.topology in line and "tp=" in line
    ]
    with open(output, "w") as fh:
        json.dump(report, fh, indent=1)
    return f"{cell.name}: exit {done.returncode} in {seconds:.0f} s"


def _dtypes(r: dict) -> str:
    weights = {"gguf": "GGUF Q4_1", "int8": "int8"}.get(r.get("quantization"), "bf16")
    return f"{weights} / {r.get('kv_cache_dtype', '?').replace('float8_e4m3fn', 'fp8').replace('bfloat16', 'bf16')}"


def _status(r: dict) -> str:
    if r.get("crashed"):
        return "crashed: " + " ".join(r["crashed"])
    if r.get("refused"):
        return "refused: " + r["refused"]
    compiled = sum(p["error"] is None for p in r["programs"])
    ok = r.get("exit_code") == 0
    return f"{'ok' if ok else 'FAIL'} ({compiled}/{len(r['programs'])})" + (
        "" if ok else ": " + "; ".join(r["failure_lines"])[:300]
    )


def _projection(raw: dict) -> dict | None:
    """The roofline projection, recomputed from the report (aot/roofline.py's arithmetic of now)."""
    from jaxserve.aot.chips import Target
    from jaxserve.aot.compile_check import Report
    from jaxserve.aot.roofline import Workload, project

    report = Report.from_dict(raw)
    return project(report, Target.parse(report.target).chip, Workload(**raw["workload"]))


def tables(output_dir: str) -> str:
    reports = []
    for name in sorted(os.listdir(output_dir)):
        if name.endswith(".json"):
            with open(os.path.join(output_dir, name)) as fh:
                reports.append(json.load(fh))
    lines = ["| cell | model | slice | tp | weights / KV | programs | result | weights GiB/chip | KV pool GiB/chip (tokens) | XLA peak GiB / HBM GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in reports:
        if r.get("crashed"):
            lines.append(f"| {r['cell']} | | | | | | {_status(r)} | | | |")
            continue
        model = os.path.basename(r["model"]) if r["model"] != "default model" else "SmolLM2-135M (default)"
        memory = (
            f"{r['weight_bytes'] / GiB:.2f} | {r['kv_pool_bytes'] / GiB:.2f} ({r['kv_tokens']:,}) | "
            f"{r['peak_bytes'] / GiB:.2f} / {r['hbm_bytes'] / GiB:.2f}"
            if not r.get("refused") else "| |"
        )  # fmt: skip
        lines.append(
            f"| {r['cell']} | {model} | {r['target']} | {r['tensor_parallel_size']} | {_dtypes(r)} | "
            f"{len(r['programs'])} | {_status(r)} | {memory} |"
        )
    lines += ["", "| tpu-inference gate | slice | tp | concurrency | decode step ms (bound) | prefill chunk ms | "
              "projected output tok/s | projected req/s | CI gate req/s |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in reports:
        if not r["cell"].startswith("gate_") or r.get("crashed") or r.get("refused"):
            continue
        p, model = _projection(r), os.path.basename(r["model"])
        if p is None:
            continue
        lines.append(
            f"| {model} | {r['target']} | {r['tensor_parallel_size']} | {p['concurrency']} | "
            f"{p['decode_step_ms']:.2f} ({p['decode_bound']}) | {p['prefill_chunk_ms']:.2f} | {p['output_tok_s']:,.0f} | "
            f"{p['req_s']:.2f} | {GATES[model][4]} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--set", choices=("gates", "matrix", "full", "all"), default=None, help="Which cells to run."
    )
    parser.add_argument("--programs", default="quick", help="The matrix cells' --programs (gates: plain).")
    parser.add_argument("--only", default="", help="Run only cells whose name contains this.")
    parser.add_argument("--jobs", type=int, default=1, help="Cells compiled at once.")
    parser.add_argument("--output-dir", default=DEFAULT_DIR)
    parser.add_argument(
        "--tables", action="store_true", help="Write tables.md from the reports in --output-dir."
    )
    ns = parser.parse_args(argv)
    os.makedirs(ns.output_dir, exist_ok=True)
    cells = []
    if ns.set in ("gates", "all"):
        cells += gate_cells()
    if ns.set in ("matrix", "all"):
        cells += matrix_cells(ns.programs)
    if ns.set in ("full", "all"):
        cells += full_cells()
    cells = [c for c in cells if ns.only in c.name]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, ns.jobs)) as pool:
        for line in pool.map(lambda c: run_cell(c, ns.output_dir), cells):
            print(f"[{time.perf_counter() - start:6.0f} s] {line}", flush=True)
    if ns.tables:
        with open(os.path.join(ns.output_dir, "tables.md"), "w") as fh:
            fh.write(tables(ns.output_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
