"""benchmarks/embeddings.py on a tiny sentence-transformers folder: jaxserve and
sentence-transformers are timed on the same inputs, and their embeddings and rerank scores agree."""

from __future__ import annotations

import json

import torch
import transformers
from benchmark_scripts import load_benchmark
from tiny_models import TINY_LLAMA, make_tokenizer


def test_embeddings_and_rerank_against_sentence_transformers(tmp_path, capsys):
    bench = load_benchmark("embeddings")
    folder = tmp_path / "st"
    torch.manual_seed(0)
    transformers.LlamaModel(transformers.LlamaConfig(**TINY_LLAMA)).save_pretrained(folder)
    tokenizer = make_tokenizer(TINY_LLAMA["vocab_size"])
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(folder)
    bench.write_st_files(str(folder), TINY_LLAMA["hidden_size"])
    out = tmp_path / "embeddings.json"
    argv = ["--model", str(folder), "--inputs", "12", "--tokens", "16", "--batch-size", "4", "--rounds", "1"]
    argv += ["--documents", "6"]
    assert bench.main([*argv, "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert set(runs) == {"sentence-transformers", "jaxserve"}
    assert runs["sentence-transformers"]["embed_ratio"] == 1.0
    assert runs["jaxserve"]["embeddings_per_s"] > 0 and runs["jaxserve"]["rerank_pairs_per_s"] > 0
    assert runs["jaxserve"]["worst_cosine_to_st"] > 0.99999
    assert runs["jaxserve"]["rerank_max_abs_diff_to_st"] < 1e-4
    assert 8 <= report["tokens_per_input"] <= 40
    assert capsys.readouterr().out.count("embeddings/s") == 2
