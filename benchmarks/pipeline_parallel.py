"""Pipeline parallel on fake CPU devices: throughput of pp=2 against pp=1, and the timeline of a
prefill step through the stages.

Every configuration serves the default model (--quantization none: float32 stacks) to the same
batch of prompts, greedily, in one process whose CPU is split into fake devices: no
configuration can be faster than one device by more than the cores one device leaves idle, since
the devices share the same cores. Reported: decode and prefill tokens/s of each configuration and
their ratio to the first (pp=1 on one device), and whether each gave the same tokens. A decode
step goes through the stages as one batch (the stages take turns: pp=2 does the work of pp=1 plus
a permute of the activations and a sum of the output per step); a prefill step of T tokens as
T / 256 microbatches (layers/pipeline.py), the stages working at once on different ones.

The timeline: for each configuration with stages, an engine built under
`pipeline.record_timeline()` prefills the same batch once, and each stage's start and end of each
microbatch (host callbacks in the step) give the milliseconds during which two stages or more
worked at once ("overlap"), against the step's span. A configuration's microbatching is chosen by
its suffix: "2x1m0" never cuts a step (one batch in the pipeline), "2x1m128" cuts into
microbatches of at least 128 tokens; no suffix, the default (256).

    python benchmarks/pipeline_parallel.py [--configs 1x1 2x1m0 2x1] [--batch 8] [--prompt-len 128]
        [--max-tokens 64] [--rounds 2] [--max-num-batched-tokens N] [--output-json FILE]

A configuration is PPxTP[mTOKENS]. The device count is fixed when JAX starts: this script sets
it (8).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()


def _engine(model: str | None, config: str, budget: int | None):
    from jaxserve import LLM

    sizes, _, microbatch = config.partition("m")
    pp, tp = map(int, sizes.split("x"))
    compilation = {} if not microbatch else {"pipeline_microbatch_tokens": int(microbatch)}
    return LLM(
        model,
        quantization="none",
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        max_num_seqs=16,
        compilation_config=compilation,
        **({} if budget is None else {"max_num_batched_tokens": budget}),
    )


def busy_together(events: Sequence[tuple]) -> dict:
    """A step's stamps (pipeline.Timeline events) -> each stage's [start, end] ms per microbatch
    from the step's first stamp, the step's span, and the ms during which 2+ stages worked."""
    t0 = min(e[0] for e in events)
    spans = collections.defaultdict(dict)  # stage -> microbatch -> [start, end] over its devices
    for seconds, stage, m, _, kind in events:
        ms = (seconds - t0) * 1e3
        start, end = spans[stage].get(m, (ms, ms))
        spans[stage][m] = (min(start, ms), end) if kind == "start" else (start, max(end, ms))
    edges = sorted(
        (t, +1 if i == 0 else -1)
        for stage in spans.values()
        for span in stage.values()
        for i, t in enumerate(span)
    )
    overlap, working, last = 0.0, 0, 0.0
    for t, change in edges:
        if working >= 2:
            overlap += t - last
        working, last = working + change, t
    stages = [[spans[s][m] for m in sorted(spans[s])] for s in sorted(spans)]
    span = max(e for stage in stages for _, e in stage)
    return {"stages_ms": stages, "span_ms": span, "overlap_ms": overlap, "overlap_fraction": overlap / span}


def timeline(model: str | None, config: str, budget: int | None, prompts, params) -> dict:
    """The stamps of the prefill step of `prompts` (one step) on a fresh engine of `config`."""
    from jaxserve.layers import pipeline

    with pipeline.record_timeline() as recorded:
        llm = _engine(model, config, budget)
        llm.generate(prompts, params, use_tqdm=False)  # compiles on the way: stamps only when run
        recorded.events.clear()
        llm.reset_prefix_cache()
        llm.generate(prompts, params, use_tqdm=False)
    del llm
    return {"microbatches": recorded.events[0][3], **busy_together(recorded.events)}


def _timed(llm, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def measure(
    model: str | None,
    configs: Sequence[str],
    batch: int,
    prompt_len: int,
    max_tokens: int,
    rounds: int,
    budget: int | None = None,  # the engines' max_num_batched_tokens (None: the default)
) -> dict:
    """Per configuration: prefill tokens/s (one output token) and decode tokens/s (the rest of
    max_tokens, the prefill's time taken off), medians over rounds that alternate configurations."""
    import random

    from jaxserve import SamplingParams

    engines = {c: _engine(model, c, budget) for c in configs}
    vocab = min(40000, engines[configs[0]].llm_engine.runner.args.vocab_size)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]} for _ in range(batch)
    ]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = {}
    for c, llm in engines.items():  # compile every program on the way; the same tokens everywhere
        llm.reset_prefix_cache()
        tokens[c] = [o.outputs[0].token_ids for o in llm.generate(prompts, many, use_tqdm=False)]
    prefill, decode = collections.defaultdict(list), collections.defaultdict(list)
    for _ in range(rounds):
        for c, llm in engines.items():
            llm.reset_prefix_cache()
            seconds, _ = _timed(llm, prompts, one)
            prefill[c].append(batch * prompt_len / seconds)
            llm.reset_prefix_cache()
            total, n = _timed(llm, prompts, many)
            decode[c].append((n - batch) / max(total - seconds, 1e-9))
    base = configs[0]
    engines.clear()  # (their memory, before the timelines' engines)
    rows = {}
    for c in configs:
        p, d = statistics.median(prefill[c]), statistics.median(decode[c])
        rows[c] = {
            "prefill_tok_s": p,
            "decode_tok_s": d,
            "prefill_ratio": p / statistics.median(prefill[base]),
            "decode_ratio": d / statistics.median(decode[base]),
            "same_tokens_as_" + base: tokens[c] == tokens[base],
        }
        if not c.startswith("1x"):
            rows[c]["prefill_timeline"] = timeline(model, c, budget, prompts, one)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmarks/pipeline_parallel.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=None, help="Default: the default model.")
    parser.add_argument(
        "--configs", nargs="+", default=["1x1", "2x1m0", "2x1"], help="PPxTP[mTOKENS]; the first is the base."
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="The engines' (fewer buckets to compile)."
    )
    parser.add_argument("--output-json", default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    rows = measure(
        ns.model, ns.configs, ns.batch, ns.prompt_len, ns.max_tokens, ns.rounds, ns.max_num_batched_tokens
    )
    for c, r in rows.items():
        print(json.dumps({"config": c, **{k: v for k, v in r.items() if k != "prefill_timeline"}}))
        if "prefill_timeline" in r:
            t = r["prefill_timeline"]
            print(
                f"  prefill step: {t['microbatches']} microbatch(es), span {t['span_ms']:.1f} ms, "
                f"2+ stages working {t['overlap_ms']:.1f} ms ({100 * t['overlap_fraction']:.0f}%)"
            )
            for stage, spans in enumerate(t["stages_ms"]):
                print(f"  stage {stage}: " + "  ".join(f"[{a:.1f}, {b:.1f}]" for a, b in spans))
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            report = {
                "config": vars(ns),
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "results": rows,
            }
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
