"""Embedding throughput: jaxserve's pooling engine against sentence-transformers (torch, CPU) on the
same weights, in one process, rounds alternating.

The model is a sentence-transformers folder (modules.json: MEAN pooling, Normalize). By default
it is made once from the default model's GGUF file (transformers' GGUF loader, float32, saved as
safetensors under ~/.cache/jaxserve/benchmarks/), so both sides read the same float32 weights;
`--gguf` adds jaxserve on the GGUF file itself (its 4-bit kernels) as a third run. Work: N inputs
of about T tokens (random token ids decoded to text, the same strings for every run); embeddings/s
= N / wall time. Then rerank: one query against D of them (LLM.score, cosine similarity), pairs/s,
and sentence-transformers' encode + similarity for the same pairs. The median round of each is
reported with its ratio to sentence-transformers in the same round, and the cosine similarity of
the two sides' embeddings (the worst input). (On a 2-core CPU one pass of 256 x 128 tokens through
a 135M model is about two minutes.)

    python benchmarks/embeddings.py [--model ST_FOLDER] [--inputs 256] [--tokens 128] [--documents 64]
        [--rounds 2] [--batch-size 32] [--gguf] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

DEFAULT_GGUF = "~/.cache/jaxserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FOLDER = "~/.cache/jaxserve/benchmarks/smollm2-135m-st"


def st_folder_from_gguf(gguf: str, folder: str) -> str:
    """A sentence-transformers folder (MEAN pooling, Normalize) of the GGUF model's float32 weights."""
    if os.path.isfile(os.path.join(folder, "modules.json")):
        return folder
    import torch
    from transformers import AutoModel, AutoTokenizer

    directory, name = os.path.split(gguf)
    model = AutoModel.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # (transformers will not save a model it read from GGUF: its float32 tensors and config, by hand)
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(folder, "model.safetensors")
    )
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_st_files(folder, model.config.hidden_size)
    return folder


def write_st_files(folder: str, hidden_size: int) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    with open(os.path.join(folder, "modules.json"), "w") as fh:
        json.dump(modules, fh)
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as fh:
        json.dump({"word_embedding_dimension": hidden_size, "pooling_mode_mean_tokens": True}, fh)


def make_texts(tokenizer, n: int, tokens: int, seed: int = 0) -> list[str]:
    """n texts of random token ids (special tokens left out), each about `tokens` long once re-read."""
    import numpy as np

    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(min(len(tokenizer), 32000)) if i not in special]
    return [tokenizer.decode(rng.choice(vocab, tokens).tolist()) for _ in range(n)]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run(ns) -> dict:
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from jaxserve import LLM

    folder = (
        os.path.expanduser(ns.model)
        if ns.model
        else st_folder_from_gguf(os.path.expanduser(DEFAULT_GGUF), os.path.expanduser(DEFAULT_FOLDER))
    )
    st = SentenceTransformer(folder, device="cpu")
    # a step of batch_size inputs fills the largest token bucket (a budget twice that would run
    # every step in a bucket half padding: the scheduler stops at max_num_seqs first)
    common = {"max_model_len": ns.tokens * 2, "max_num_seqs": ns.batch_size,
              "max_num_batched_tokens": ns.batch_size * ns.tokens, "use_tqdm_on_load": False,
              "compilation_config": {"cache_dir": ""}}  # fmt: skip
    engines = {"jaxserve": LLM(folder, **common)}
    if ns.gguf:
        engines["jaxserve-gguf"] = LLM(os.path.expanduser(DEFAULT_GGUF), runner="pooling",
                                       pooler_config={"pooling_type": "MEAN"}, **common)  # fmt: skip
    texts = make_texts(st.tokenizer, ns.inputs, ns.tokens)
    num_tokens = sum(len(ids) for ids in st.tokenizer(texts)["input_ids"])
    query, documents = texts[0][: len(texts[0]) // 4], texts[: ns.documents]

    def st_embed():
        return st.encode(texts, batch_size=ns.batch_size)

    def st_rerank():
        return st.similarity(st.encode([query]), st.encode(documents, batch_size=ns.batch_size))[0].numpy()

    runs = {"sentence-transformers": (st_embed, st_rerank)}
    for name, llm in engines.items():
        runs[name] = (
            lambda llm=llm: np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]),
            lambda llm=llm: np.array([o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]),
        )
    st.encode(texts[: ns.batch_size], batch_size=ns.batch_size)  # warm (jaxserve compiled at start-up)
    seconds = {name: {"embed": [], "rerank": []} for name in runs}
    outputs = {}
    for _ in range(ns.rounds):
        for name, (embed, rerank) in runs.items():
            t, outputs[name] = timed(embed)
            seconds[name]["embed"].append(t)
            t, outputs[name + "/rerank"] = timed(rerank)
            seconds[name]["rerank"].append(t)
    base = {k: statistics.median(v) for k, v in seconds["sentence-transformers"].items()}
    report = {"model": folder, "inputs": ns.inputs, "tokens_per_input": num_tokens / ns.inputs,
              "rerank_documents": len(documents), "batch_size": ns.batch_size, "rounds": ns.rounds,
              "runs": {}}  # fmt: skip
    for name, times in seconds.items():
        embed_s, rerank_s = statistics.median(times["embed"]), statistics.median(times["rerank"])
        ours, ref = outputs[name], outputs["sentence-transformers"]
        cosines = np.sum(ours * ref, axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
        report["runs"][name] = {
            "embeddings_per_s": ns.inputs / embed_s,
            "embed_ratio": base["embed"] / embed_s,
            "rerank_pairs_per_s": len(documents) / rerank_s,
            "rerank_ratio": base["rerank"] / rerank_s,
            "worst_cosine_to_st": float(cosines.min()),
            "rerank_max_abs_diff_to_st": float(
                np.abs(outputs[name + "/rerank"] - outputs["sentence-transformers/rerank"]).max()
            ),
        }
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="a sentence-transformers folder (default: made from the GGUF)"
    )
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--documents", type=int, default=64, help="documents of the rerank query")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gguf", action="store_true", help="also jaxserve on the GGUF file (4-bit kernels)")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    report = run(ns)
    for name, r in report["runs"].items():
        print(
            f"{name:22s} {r['embeddings_per_s']:8.1f} embeddings/s ({r['embed_ratio']:.2f}x)  "
            f"rerank {r['rerank_pairs_per_s']:8.1f} pairs/s ({r['rerank_ratio']:.2f}x)  "
            f"worst cosine to ST {r['worst_cosine_to_st']:.6f}"
        )
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
