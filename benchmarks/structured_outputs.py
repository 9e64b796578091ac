"""The cost of structured outputs: the same batch unconstrained and with every request under a JSON
schema, in one engine, interleaved rounds (best of each), plus the host's mask-fill time per step.

Where it sits: on the offline `LLM` API, like throughput.py. Every request decodes exactly
--output-len tokens both ways (greedy; EOS ignored when unconstrained, and the schema is an array
long enough that the constrained run stops on length too), so output tok/s compare the same work
but for the mask: llguidance filling the constrained rows on the host while the device runs the
forward pass, the mask's transfer, and its application before sampling.

    python benchmarks/structured_outputs.py --num-prompts 32 --input-len 64 --output-len 64 [engine flags]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

from throughput import random_prompts

from jaxserve.cli import ArgumentParser, add_engine_args, engine_args_from_namespace, make_llm, parse_args

# A list of records: nested objects, enums, bounded integers, strings with a length limit. Long
# enough (minItems) that no request completes it within --output-len tokens.
SCHEMA = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "role", "address"],
        "additionalProperties": False,
    },
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="benchmarks/structured_outputs.py",
        description="Throughput with every request under a JSON schema against unconstrained, same engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--input-len", type=int, default=64, help="Prompt length in tokens.")
    parser.add_argument("--output-len", type=int, default=64, help="Generated tokens per prompt.")
    parser.add_argument("--num-prompts", type=int, default=32, help="Number of prompts, all in one batch.")
    parser.add_argument("--rounds", type=int, default=3, help="Interleaved rounds; the best of each is kept.")
    parser.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    add_engine_args(parser, model_positional=False)
    return parser


class FillTimer:
    """Wraps the engine's GrammarCompiler.fill: the host time of each step's mask fill."""

    def __init__(self, compiler):
        self.compiler, self.inner, self.times = compiler, compiler.fill, []
        compiler.fill = self

    def __call__(self, rows, bitmask) -> None:
        start = time.perf_counter()
        self.inner(rows, bitmask)
        self.times.append(time.perf_counter() - start)


def run(llm, requests: list[dict], output_len: int, rounds: int) -> dict:
    from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

    plain = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=output_len, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    timer = FillTimer(llm.llm_engine.grammars)
    variants = {"unconstrained": plain, "json_schema": constrained}
    for params in variants.values():  # compile each step variant, and the grammar, first
        llm.generate(requests, params.clone(max_tokens=2), use_tqdm=False)
    results = {name: {"elapsed": float("inf")} for name in variants}
    for _ in range(rounds):
        for name, params in variants.items():
            timer.times.clear()
            start = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = [len(c.token_ids) for out in outputs for c in out.outputs]
            assert all(n == output_len for n in tokens), f"{name}: a request stopped early: {tokens}"
            if name == "json_schema":
                for out in outputs:  # every output is a prefix the schema allows (cut by max_tokens)
                    assert out.outputs[0].text.startswith("["), out.outputs[0].text
            if elapsed < results[name]["elapsed"]:
                results[name] = {
                    "elapsed": elapsed,
                    "output_tokens_per_second": sum(tokens) / elapsed,
                    "steps": output_len,
                    "ms_per_step": 1000 * elapsed / output_len,
                }
                if timer.times:
                    results[name]["mask_fill_ms_per_step"] = {
                        "mean": 1000 * statistics.mean(timer.times),
                        "median": 1000 * statistics.median(timer.times),
                        "max": 1000 * max(timer.times),
                        "num_fills": len(timer.times),
                    }
    base = results["unconstrained"]["output_tokens_per_second"]
    for r in results.values():
        r["ratio_to_unconstrained"] = r["output_tokens_per_second"] / base
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parse_args(parser, argv)
    load_at_start = os.getloadavg()[0]
    try:
        engine_args = engine_args_from_namespace(ns)
        engine_args.max_num_seqs = max(engine_args.max_num_seqs, ns.num_prompts)
        llm = make_llm(engine_args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    vocab = int(llm.llm_engine.config.model_config.get("vocab_size"))
    requests = [
        {"prompt_token_ids": row.tolist()}
        for row in random_prompts(ns.num_prompts, ns.input_len, vocab, ns.seed)
    ]
    results = run(llm, requests, ns.output_len, ns.rounds)
    for name, r in results.items():
        fill = r.get("mask_fill_ms_per_step")
        extra = f", mask fill {fill['mean']:.2f} ms/step (max {fill['max']:.2f})" if fill else ""
        print(
            f"{name}: {r['output_tokens_per_second']:.1f} output tok/s, {r['ms_per_step']:.1f} ms/step, "
            f"{r['ratio_to_unconstrained']:.3f}x unconstrained{extra}"
        )
    if ns.output_json:
        record = {
            "config": {
                "model": engine_args.model,
                "num_prompts": ns.num_prompts,
                "input_len": ns.input_len,
                "output_len": ns.output_len,
                "rounds": ns.rounds,
                "schema": SCHEMA,
                "load_average_at_start": load_at_start,
                "cpu_count": os.cpu_count(),
            },
            "results": results,
        }
        with open(ns.output_json, "w") as fh:
            json.dump(record, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
