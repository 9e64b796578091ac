"""benchmarks/vlm.py on its tiny model (the same checkpoint code, SmolVLM's structure at small
shapes, the default model's tokenizer): the checkpoint serves image prompts, and the report has
every figure, with a warm encoder cache faster than a cold one."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_image_prompt_costs_on_a_tiny_vlm(default_gguf, tmp_path, capsys):
    out = tmp_path / "vlm.json"
    argv = ["--tiny", "--model-dir", str(tmp_path / "model"), "--tokenizer-gguf", default_gguf, "--reps", "2"]
    argv += ["--decode-tokens", "8", "--max-model-len", "1024", "--max-num-batched-tokens", "512"]
    assert load_benchmark("vlm").main([*argv, "--enforce-eager", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"]["tiles"] == {"one_tile": 1, "split": 17}  # 512 px: 4x4 tiles + the global one
    split, one_tile = report["ttft"]["split"], report["ttft"]["one_tile"]
    assert split["prompt_tokens"] > 17 * report["model"]["tokens_per_tile"] > one_tile["prompt_tokens"]
    for r in (split, one_tile):
        assert min(r["cold"]["ttft_s"], r["warm"]["ttft_s"], r["text_s"]) > 0
        assert r["cold"]["image_processing_s"] > 0 and r["cold"]["encoder_s"] > 0
        assert r["warm"]["encoder_s"] == 0  # served from the encoder cache
    assert split["warm"]["ttft_s"] < split["cold"]["ttft_s"]
    for r in report["encoder"].values():
        assert r["images_per_s"] > 0 and r["tiles_per_s"] > 0
    assert report["decode"]["after_image_tok_per_s"] > 0 and report["decode"]["after_text_tok_per_s"] > 0
    assert report["encoder_cache"]["misses"] >= 2 * 2 and report["encoder_cache"]["hits"] >= 2 * 2
    assert report["machine"]["cpu_count"] > 0
    assert "tiles/s" in capsys.readouterr().out
    # a second run finds the checkpoint made
    assert load_benchmark("vlm").build_checkpoint(str(tmp_path / "model"), None, None) == str(
        tmp_path / "model"
    )
