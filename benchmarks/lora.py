"""Multi-LoRA throughput: 32 requests over 1, 4 and 8 distinct adapters against the base model.

Random PEFT adapters (rank 16 by default, every Llama projection adapted) are written for the
default model with numpy into a temporary directory. Three engines run the same work: `base`
(LoRA not enabled), and one with --enable-lora --max-loras 8 --max-lora-rank 16, which serves
`lora-0` (the requests on the base model: the cost of the slots alone), then `lora-N` (the
requests spread round-robin over N adapters, all in one batch). Each run: B requests of a
P-token prompt generate T tokens (EOS ignored); throughput = B * T / wall time, prefill included.
Every shape is compiled and every adapter written once before timing; the runs alternate
within each round, the median round is reported with its ratio to `base` in the same round, and
the share of requests whose greedy tokens differ from the base model's (0 for `lora-0`: the
adapters are really applied, and only where asked).

    python benchmarks/lora.py [--adapters 1 4 8] [--requests 32] [--tokens 64] [--rounds 3]
        [--rank 16] [--model GGUF] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

DEFAULT_MODEL = "~/.cache/jaxserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: str, spec, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter of a Llama-style model whose LoRA slots `spec` describes
    (lora/adapter.py's AdapterSpec); B not zero, so it changes the output."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shapes = spec.shapes
    tensors = {}
    for layer in range(spec.num_layers):
        for proj in TARGETS:
            d_in, d_out = shapes[proj]
            part = "self_attn" if proj in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, d_in**-0.5, (rank, d_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.01, (d_out, rank)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    with open(os.path.join(path, "adapter_config.json"), "w") as fh:
        json.dump(config, fh)


def _run(llm, prompts, tokens: int, loras) -> tuple[float, list[list[int]]]:
    """(tok/s, each request's tokens)."""
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, [o.outputs[0].token_ids for o in outs]


def run(ns) -> dict:
    import numpy as np

    from jaxserve import LLM
    from jaxserve.lora.request import LoRARequest

    model = os.path.expanduser(ns.model)
    # compiled in this process only, neither reading nor filling the start-up executable cache:
    # a measurement should not depend on what an earlier run stored
    common = {"max_model_len": ns.max_model_len, "max_num_seqs": ns.requests, "kv_cache_memory_bytes": "256M",
              "enforce_eager": ns.enforce_eager, "compilation_config": {"cache_dir": ""}}  # fmt: skip
    base = LLM(model, **common)
    lora = LLM(model, enable_lora=True, max_loras=max(ns.adapters), max_lora_rank=ns.rank, **common)
    directory = tempfile.mkdtemp(prefix="jaxserve-lora-bench-")
    adapters = []
    for i in range(max(ns.adapters)):
        path = os.path.join(directory, f"adapter-{i}")
        write_adapter(path, lora.llm_engine.runner.adapter_spec, ns.rank, seed=i)
        adapters.append(LoRARequest(f"adapter-{i}", i + 1, path))
    vocab = base.llm_engine.config.model_config.get("vocab_size")
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(3, vocab, ns.prompt_tokens).tolist()} for _ in range(ns.requests)
    ]
    runs = {"base": (base, None), "lora-0": (lora, None)}
    for n in ns.adapters:
        runs[f"lora-{n}"] = (lora, [adapters[i % n] for i in range(ns.requests)])
    # compile every shape and write every adapter before timing; keep each run's tokens
    tokens = {name: _run(llm, prompts, ns.tokens, loras)[1] for name, (llm, loras) in runs.items()}
    rounds = [{name: _run(llm, prompts, ns.tokens, loras)[0] for name, (llm, loras) in runs.items()}
              for _ in range(ns.rounds)]  # fmt: skip
    report = {}
    for name in runs:
        report[name] = {
            "tok_s": statistics.median(r[name] for r in rounds),
            "ratio": statistics.median(r[name] / r["base"] for r in rounds),
            "rounds": [r[name] for r in rounds],
            # requests whose greedy tokens differ from the base model's: 0 without an adapter
            "changed": sum(a != b for a, b in zip(tokens[name], tokens["base"])) / ns.requests,
        }
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/lora.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="Tokens generated per request.")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--enforce-eager", action="store_true", help="Compile step shapes on first use.")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    report = run(ns)
    for name, r in report.items():
        print(
            f"{name:8s} {r['tok_s']:7.1f} tok/s ({r['ratio']:.2f}x base), {r['changed']:.0%} of outputs not the base's",
            flush=True,
        )
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            json.dump({"config": vars(ns), "cpu_count": os.cpu_count(), "runs": report}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
