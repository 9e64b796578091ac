"""Sleep mode: device memory freed by LLM.sleep and the time to sleep and to wake, per level.

One engine with --enable-sleep-mode on the model given (by default the default model, served from
its GGUF file): greedy tokens first, then for each level and round: sleep, wake_up, the same
prompts again. Device memory is what JAX's live arrays hold on the devices (on a CPU that is host
memory, and level 1's host copy of the weights lives beside it: the saving is real on an
accelerator); "same" says whether the tokens after waking equal the first ones.

    python benchmarks/sleep_mode.py [--levels 1 2] [--rounds 3] [--model M] [--output-json FILE]
        [--max-model-len 1024] [--enforce-eager]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

DEFAULT_MODEL = "~/.cache/jaxserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village by the sea,"]


def device_bytes() -> int:
    import gc

    import jax

    gc.collect()
    from jaxserve.runner.model_runner import bytes_per_device

    return sum(bytes_per_device(jax.live_arrays()).values())


def run(ns: argparse.Namespace) -> dict:
    from jaxserve import LLM, SamplingParams

    # Arrays another engine in this process still holds are not this engine's to free.
    before = device_bytes()
    llm = LLM(
        os.path.expanduser(ns.model),
        enable_sleep_mode=True,
        max_model_len=ns.max_model_len,
        enforce_eager=ns.enforce_eager,
        use_tqdm_on_load=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=ns.tokens)

    def tokens() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    want = tokens()
    awake = device_bytes() - before
    report = {"awake_bytes": awake, "levels": {}}
    for level in ns.levels:
        rounds = []
        for _ in range(ns.rounds):
            start = time.perf_counter()
            llm.sleep(level)
            slept = time.perf_counter()
            asleep = device_bytes() - before
            llm.wake_up()
            woke = time.perf_counter()
            rounds.append(
                {
                    "sleep_s": slept - start,
                    "wake_s": woke - slept,
                    "freed_bytes": awake - asleep,
                    "same": tokens() == want,
                }
            )
        report["levels"][level] = {
            "sleep_s": statistics.median(r["sleep_s"] for r in rounds),
            "wake_s": statistics.median(r["wake_s"] for r in rounds),
            "freed_fraction": min(r["freed_bytes"] for r in rounds) / awake,
            "same": all(r["same"] for r in rounds),
            "rounds": rounds,
        }
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/sleep_mode.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="Greedy tokens per prompt.")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--enforce-eager", action="store_true", help="Compile step shapes on first use.")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    report = run(ns)
    print(f"awake: {report['awake_bytes'] / 2**20:.1f} MiB on the devices")
    for level, r in report["levels"].items():
        print(
            f"level {level}: freed {r['freed_fraction']:.1%}, sleep {r['sleep_s']:.3f} s, "
            f"wake {r['wake_s']:.3f} s, tokens after waking {'the same' if r['same'] else 'DIFFERENT'}",
            flush=True,
        )
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            json.dump({"config": vars(ns), "cpu_count": os.cpu_count(), **report}, fh, indent=1)
    return 0 if all(r["same"] for r in report["levels"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
