"""Every model shape x TPU chip x tensor parallel size x weight/KV dtype through
`jaxserve tpu-compile-check`, and the tables made from the results.

Each cell is one run of the command (a subprocess: libtpu compiles on this host, nothing runs) that
writes its JSON report into --output-dir; a cell whose report is there already is not run again,
so a long matrix resumes. `--tables` then writes one Markdown file from every report there: which
cells compiled and fit (or why not), the memory per chip, and the projected throughput of the
tpu-inference CI's benchmark shapes next to the gates that CI holds them to.

    python benchmarks/tpu_compile_matrix.py --set gates            # tpu-inference's CI shapes
    python benchmarks/tpu_compile_matrix.py --set matrix --jobs 2  # the whole matrix, quick
    python benchmarks/tpu_compile_matrix.py --set full --jobs 2    # every bucket and variant
    python benchmarks/tpu_compile_matrix.py --tables               # the Markdown from the reports

Time on a 2-core VM with --jobs 2: the quick matrix (two programs a cell, 123 cells) about half an
hour; a --programs default cell (56 programs: every bucket, every variant at the smallest and
largest) 10 to 25 minutes, the six `full` cells about an hour and a half.
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
    "fp8/fp8": ("-q", "fp8", "--kv-cache-dtype", "fp8"),
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


PREAMBLE = [
    "# jaxserve's step programs compiled for TPU slices (libtpu on a CPU host; nothing ran)",
    "",
    "Made by `benchmarks/tpu_compile_matrix.py --tables` from the JSON reports beside this file, each one",
    "run of `jaxserve tpu-compile-check` (libtpu 0.0.42.1, jax 0.10.2): the configuration `serve` would",
    "build on the slice, the model's abstract weights with the engine's shardings, the KV pool the engine",
    "would allocate at --gpu-memory-utilization 0.9 of the chip's HBM, and the runner's own step programs",
    "compiled by libtpu with the Pallas attention kernel. Cells named `full_` compile every token bucket",
    "and every sampler / structured-output variant (`--programs default`); the others the smallest and",
    "largest bucket (`--programs quick`); `gate_` cells every bucket at tpu-inference's CI settings.",
    "",
    "A refusal is the engine's own, before any compile: weights that leave no room for a KV pool in the",
    "chip's HBM (a hardware limit; the row says how many GiB and which tp would fit), or a model whose",
    "heads do not split over the devices (the default model's 9 query heads split over 1, 3 or 9).",
    "The prompt-logprobs variants rank every fed token against the whole vocabulary 512 rows at a",
    "time (runner/step.py): at the 8192-token bucket of an 8B model on one chip, all at once needed",
    "23.5 to 36 GiB of temporaries (8192 x 128k float32 logits and their log-softmax) and failed; in",
    "chunks the same programs need under 1.1 GiB, like the plain step.",
    "",
    "The throughput projection is a roofline estimate from the model's per-device bytes and FLOPs and",
    "the chip's published peaks (jaxserve/aot/roofline.py); no TPU ran anything, and real throughput",
    "is lower.",
    "",
]


def _grid(reports: list[dict]) -> list[str]:
    """One row per model and dtypes, one column per slice: ok, no room (the weights leave none for
    a KV pool), no split (the model's heads do not split over the devices) or FAIL."""
    cells, columns = {}, []
    for r in reports:
        if r["cell"].startswith("gate_") or r.get("crashed"):
            continue
        model = os.path.basename(r["model"]) if r["model"] != "default model" else "SmolLM2-135M (default)"
        column = f"{r['target']} tp{r['tensor_parallel_size']}"
        if column not in columns:
            columns.append(column)
        refused = r.get("refused") or ""
        mark = "no room" if "KV cache" in refused else "no split" if refused else _status(r).split(" ")[0]
        cells.setdefault((model, _cell_dtypes(r)), {})[column] = mark + (
            " (all)" if r["cell"].startswith("full_") else ""
        )
    columns.sort(key=lambda c: (int(c.rsplit("tp", 1)[1]), c))
    lines = ["## ok / fail per cell", "", "| model | weights / KV | " + " | ".join(columns) + " |",
             "|---|---|" + "---|" * len(columns)]  # fmt: skip
    for (model, dtypes), row in sorted(cells.items()):
        lines.append(f"| {model} | {dtypes} | " + " | ".join(row.get(c, "") for c in columns) + " |")
    return lines


def _cell_dtypes(r: dict) -> str:
    """The cell's weights / KV by its flags (a refused configuration reports no dtypes)."""
    flags = r.get("flags", [])

    def option(name: str, default: str) -> str:
        return flags[flags.index(name) + 1] if name in flags else default

    weights = option("-q", "GGUF Q4_1" if r.get("model") == "default model" else "bf16")
    return f"{weights} / {option('--kv-cache-dtype', 'bf16')}"


def tables(output_dir: str) -> str:
    reports = []
    for name in sorted(os.listdir(output_dir)):
        if name.endswith(".json"):
            with open(os.path.join(output_dir, name)) as fh:
                reports.append(json.load(fh))
    lines = [*PREAMBLE, *_grid(reports), "", "## Every cell", ""]
    lines += ["| cell | model | slice | tp | weights / KV | programs | result | weights GiB/chip | KV pool GiB/chip (tokens) | XLA peak GiB / HBM GiB |",
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
            f"| {r['cell']} | {model} | {r['target']} | {r['tensor_parallel_size']} | {_cell_dtypes(r)} | "
            f"{len(r['programs'])} | {_status(r)} | {memory} |"
        )
    lines += ["", "## Projected throughput of tpu-inference's CI gate shapes (roofline: an upper bound)", ""]
    lines += ["| tpu-inference gate | slice | tp | concurrency | decode step ms (bound) | prefill chunk ms | "
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
