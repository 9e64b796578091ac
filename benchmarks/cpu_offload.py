"""What CPU weight offload (`--cpu-offload-gb`) costs a step: the same model with every layer stack
it can move in host memory against all on the device, rounds alternating in one process.

By default the default model's GGUF file dequantized to float32 (`-q none`: its 4-bit stacks are
read whole by the native kernel and would stay on the device). Per engine: a batch-1 greedy decode
(output tokens/s over T tokens) and one prefill of P prompt tokens (seconds to its first token),
medians of the rounds, the ratio offloaded / on device, the bytes in host memory, and whether the
tokens are the same. On a CPU, device and host memory are the same RAM: the figure is the cost of
the copies a step makes (each offloaded layer's weights once a step), not of a PCIe link.

    python benchmarks/cpu_offload.py [--model M] [-q none] [--tokens 64] [--prompt-len 512]
        [--rounds 3] [--output-json FILE]
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


def run(ns: argparse.Namespace) -> dict:
    import numpy as np

    from jaxserve import LLM, SamplingParams

    common = dict(max_model_len=ns.prompt_len + ns.tokens + 8, use_tqdm_on_load=False, enable_prefix_caching=False,
                  compilation_config={"cache_dir": ""}, enforce_eager=ns.enforce_eager)  # fmt: skip
    if ns.quantization:
        common["quantization"] = ns.quantization
    engines = {
        "on_device": LLM(os.path.expanduser(ns.model), **common),
        "offloaded": LLM(os.path.expanduser(ns.model), cpu_offload_gb=ns.offload_gb, **common),
    }
    vocab = engines["on_device"].llm_engine.runner.args.vocab_size
    rng = np.random.default_rng(0)
    short = {"prompt_token_ids": rng.integers(3, vocab, 16).tolist()}
    long = {"prompt_token_ids": rng.integers(3, vocab, ns.prompt_len).tolist()}
    decode = SamplingParams(max_tokens=ns.tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0)
    times = {name: {"decode_s": [], "prefill_s": []} for name in engines}
    tokens = {}
    for _ in range(ns.rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            out = llm.generate([short], decode, use_tqdm=False)[0]
            times[name]["decode_s"].append(time.perf_counter() - start)
            tokens[name] = list(out.outputs[0].token_ids)
            start = time.perf_counter()
            llm.generate([long], first, use_tqdm=False)
            times[name]["prefill_s"].append(time.perf_counter() - start)
    report = {"model": ns.model, "quantization": ns.quantization, "tokens": ns.tokens, "prompt_len": ns.prompt_len,
              "rounds": ns.rounds, "engines": {}}  # fmt: skip
    for name, llm in engines.items():
        state = llm.llm_engine.runner.state
        host = sum(
            x.nbytes
            for x in (v.get_value() for _, v in state.flat_state())
            if x.sharding.memory_kind == "pinned_host"
        )
        decode_s, prefill_s = (statistics.median(times[name][k]) for k in ("decode_s", "prefill_s"))
        report["engines"][name] = {
            "host_weight_bytes": host,
            "decode_tok_per_s": ns.tokens / decode_s,
            "prefill_s": prefill_s,
            "times": times[name],
        }
    on, off = report["engines"]["on_device"], report["engines"]["offloaded"]
    report["decode_ratio"] = off["decode_tok_per_s"] / on["decode_tok_per_s"]
    report["prefill_ratio"] = on["prefill_s"] / off["prefill_s"]
    report["same_tokens"] = tokens["on_device"] == tokens["offloaded"]
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("-q", "--quantization", default="none")
    parser.add_argument("--offload-gb", type=float, default=64.0, help="(more than the model: every stack)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    report = run(ns)
    for name, r in report["engines"].items():
        print(
            f"{name:10s} decode {r['decode_tok_per_s']:7.1f} tok/s  prefill {r['prefill_s']:.3f} s  "
            f"{r['host_weight_bytes'] / 2**20:.1f} MiB of weights in host memory"
        )
    print(
        f"offloaded / on device: decode {report['decode_ratio']:.2f}x, prefill {report['prefill_ratio']:.2f}x; "
        + ("the same tokens" if report["same_tokens"] else "OTHER TOKENS")
    )
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
