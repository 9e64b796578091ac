"""Quantization: memory, accuracy and decode speed against the unquantized model.

The default model (float32 on the CPU) loaded once per method, all held at once: `none` (the
GGUF dequantized to float32 at load), `gguf` (its own Q4_1 / Q8_0 groups kept), `int8` and `fp8`
(weights requantized per output channel from the dequantized weights), and `kv-<dtype>` (float32
weights, the KV cache in int8, fp8 or fp8_e5m2 pages: --kv-cache-dtype, scales as the engine
picks them by default). Per method:
- weight bytes in memory (every parameter's bytes), and KV-cache tokens in the same KV budget,
  as ratios to `none`;
- accuracy on a fixed English text, teacher-forced through the public API (prompt_logprobs=1):
  perplexity, and how often the most likely next token is the unquantized model's;
- decode throughput at each batch size: B prompts of 32 tokens generate T tokens (EOS ignored),
  less the time of the same prompts generating 1 token (the prefill), so tok/s = B (T - 1) / the
  difference. The methods alternate within each round; the median round is reported, with its
  ratio to `none` measured in the same round.

    python benchmarks/quantization.py [--methods none int8 kv-int8] [--batches 1 32] [--tokens 64]
        [--rounds 3] [--model GGUF] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence

DEFAULT_MODEL = "~/.cache/jaxserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHT_METHODS = ("none", "gguf", "int8", "fp8")
KV_METHODS = ("kv-int8", "kv-fp8", "kv-fp8_e5m2")

# The fixed text for perplexity: plain expository English, written for this benchmark.
TEXT = (
    "A river begins as rain or melting snow on high ground. The water gathers in small streams, "
    "which join one another as they run downhill, and by the time they reach the plain they have "
    "become a single channel wide enough for boats. Along the way the river carries sand, clay and "
    "stones, wearing down the land it crosses and building it up again where the current slows. "
    "Farmers have settled beside rivers for thousands of years, because the floods that cover the "
    "fields each spring leave behind a layer of rich soil. Cities grew at the places where a river "
    "could be crossed or where it met the sea, and trade moved along the water long before there "
    "were roads. Today many rivers are held back by dams that store water for dry seasons and turn "
    "its fall into electricity. Engineers must balance these uses against the needs of the fish "
    "and birds that depend on the river, and against the people downstream who need the water too. "
    "Keeping a river healthy means watching what flows into it from farms, factories and towns, and "
    "remembering that everything done upstream is felt by someone further down. "
    "The first clocks were built to follow the sun. A stick set upright in the ground casts a "
    "shadow that turns through the day, and marks scratched where the shadow fell at certain hours "
    "made a simple dial. Such dials fail at night and under clouds, so people also measured time "
    "with water dripping from one vessel into another, or with candles marked in rings that burned "
    "down at a steady rate. Mechanical clocks appeared in European towns in the thirteenth "
    "century. They were driven by falling weights and kept in step by a swinging bar, and they were "
    "often so inaccurate that they had to be reset every day by the sun. The pendulum, studied by "
    "Galileo and put to use by Huygens, made clocks accurate to within a minute a day, and later "
    "improvements brought that down to seconds. Sailors needed accurate time more than anyone, "
    "because the difference between local noon and the time at a home port tells a ship how far "
    "east or west it has travelled. John Harrison spent most of his life building a clock that "
    "could keep time on a rolling ship, and his fourth design finally proved it could be done. "
    "Today the most precise clocks count the vibrations of atoms, and they are so steady that they "
    "would drift by less than a second over the age of the universe. "
    "Bread is one of the oldest prepared foods. At its simplest it is flour mixed with water and "
    "baked, but most bread is leavened, which means that gas bubbles are trapped in the dough to "
    "make it rise. Yeast, a living fungus, eats the sugars in the flour and gives off carbon "
    "dioxide, and the stretchy network of gluten formed by kneading holds the gas in place. A baker "
    "controls the result through time and temperature: a slow rise in a cool room gives more "
    "flavour, while a warm kitchen makes the dough ready sooner. When the loaf goes into the oven, "
    "the gas expands, the yeast dies, and the starches set into the soft crumb, while the surface "
    "browns into a crust. Different grains, different amounts of water and different ways of "
    "shaping the dough give the many breads found around the world, from flat loaves cooked on hot "
    "stones to tall tins of sandwich bread sliced by machines."
)


def _weight_bytes(llm) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(llm.llm_engine.runner.state))


def _kv_bytes_per_token(llm) -> float:
    spec = llm.llm_engine.runner.kv_spec
    return spec.bytes_per_block / spec.page_size


def _accuracy(llm, ids: list[int]) -> tuple[float, list[int]]:
    """(mean negative log-likelihood of the text, the most likely token at each position)."""
    from jaxserve import SamplingParams

    (out,) = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )
    nll, top = [], []
    for token, entry in zip(ids[1:], out.prompt_logprobs[1:]):
        nll.append(-entry[token].logprob)
        top.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return statistics.mean(nll), top


def _decode_tok_s(llm, batch: int, tokens: int, vocab: int) -> float:
    import numpy as np

    from jaxserve import SamplingParams

    rng = np.random.default_rng(batch)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, 32).tolist()} for _ in range(batch)]

    def timed(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0), use_tqdm=False)
        return time.perf_counter() - start

    prefill = timed(1)
    return batch * (tokens - 1) / max(timed(tokens) - prefill, 1e-9)


def run(ns) -> dict:
    from jaxserve import LLM

    model = os.path.expanduser(ns.model)
    llms = {}
    for method in ns.methods:
        kv = method.removeprefix("kv-") if method in KV_METHODS else "auto"
        llms[method] = LLM(
            model,
            quantization="none" if method in KV_METHODS else method,
            kv_cache_dtype=kv,
            dtype="float32",
            max_model_len=ns.max_model_len,
            max_num_seqs=max(ns.batches),
            kv_cache_memory_bytes="256M",
            enforce_eager=ns.enforce_eager,
        )
    tokenizer = llms[ns.methods[0]].get_tokenizer()
    ids = tokenizer.encode(TEXT)[: ns.text_tokens]
    vocab = llms[ns.methods[0]].llm_engine.config.model_config.get("vocab_size")
    base = ns.methods[0]
    report: dict = {"text_tokens": len(ids), "methods": {}}
    accuracy = {m: _accuracy(llm, ids) for m, llm in llms.items()}
    for m, llm in llms.items():
        nll, top = accuracy[m]
        same = sum(a == b for a, b in zip(top, accuracy[base][1])) / len(top)
        report["methods"][m] = {
            "weight_bytes": _weight_bytes(llm),
            "weight_bytes_ratio": _weight_bytes(llm) / _weight_bytes(llms[base]),
            "kv_tokens_ratio": _kv_bytes_per_token(llms[base]) / _kv_bytes_per_token(llm),
            "perplexity": math.exp(nll),
            "perplexity_ratio": math.exp(nll - accuracy[base][0]),
            "top1_agreement": same,
            "decode": {},
        }
    for batch in ns.batches:
        for llm in llms.values():  # compile every shape this batch needs before timing
            _decode_tok_s(llm, batch, ns.tokens, vocab)
        rounds = [
            {m: _decode_tok_s(llm, batch, ns.tokens, vocab) for m, llm in llms.items()}
            for _ in range(ns.rounds)
        ]
        for m in llms:
            report["methods"][m]["decode"][str(batch)] = {
                "tok_s": statistics.median(r[m] for r in rounds),
                "ratio": statistics.median(r[m] / r[base] for r in rounds),
                "rounds": [r[m] for r in rounds],
            }
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/quantization.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=[*WEIGHT_METHODS, *KV_METHODS],
        choices=[*WEIGHT_METHODS, *KV_METHODS],
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=64, help="Tokens generated per request.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--text-tokens", type=int, default=1024, help="Tokens of the fixed text scored (at most)."
    )
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--enforce-eager", action="store_true", help="Compile step shapes on first use.")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    report = run(ns)
    for m, r in report["methods"].items():
        speed = "  ".join(f"b{b} {d['tok_s']:7.1f} tok/s ({d['ratio']:.2f}x)" for b, d in r["decode"].items())
        print(
            f"{m:11s} weights {r['weight_bytes'] / 2**20:7.1f} MiB ({r['weight_bytes_ratio']:.2f}x)  "
            f"KV tokens {r['kv_tokens_ratio']:.1f}x  "
            f"ppl {r['perplexity']:7.3f} ({r['perplexity_ratio']:.4f}x)  top-1 {r['top1_agreement']:.3f}  {speed}",
            flush=True,
        )
    if ns.output_json:
        import json

        with open(ns.output_json, "w") as fh:
            json.dump({"config": vars(ns), "cpu_count": os.cpu_count(), **report}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
