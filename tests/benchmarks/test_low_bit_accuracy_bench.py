"""benchmarks/low_bit_accuracy.py on a tiny random Llama: its changes of basis are exact before
rounding, its GPTQ rounding stays on the fp8 grid and beats rounding to nearest on the error it
minimises, and a run reports every variant asked for."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_benchmark

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def study():
    return load_benchmark("low_bit_accuracy")


def test_gptq_lands_on_the_fp8_grid_with_less_output_error_than_rounding_to_nearest(study):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=g) * 0.05
    # correlated inputs with a few large channels, as a layer's inputs are
    x = torch.randn(512, 64, generator=g, dtype=torch.float64) @ torch.randn(
        64, 64, generator=g, dtype=torch.float64
    )
    x[:, :4] *= 8
    gptq = study.gptq_fp8(weight, x.T @ x, damp=0.01).double()
    nearest = study.engine_rounding(weight, "fp8").double()
    scale = study.fp8_scale(weight.double().abs().amax(1, keepdim=True))
    # every value an e4m3 value times its channel's scale (to float32's precision, as returned)
    assert torch.allclose(study.round_fp8(gptq, scale), gptq, rtol=1e-6, atol=0)
    assert torch.allclose(nearest, study.round_fp8(weight.double(), scale).float().double(), rtol=1e-6)
    w = weight.double()
    error = {name: float(((x @ (q - w).T) ** 2).sum()) for name, q in (("gptq", gptq), ("nearest", nearest))}
    assert error["gptq"] < 0.7 * error["nearest"], error


def test_the_attention_rewrites_are_exact_until_rounding(study, tiny_llama_gqa):
    model = study.load(tiny_llama_gqa[0])[1]
    ids = list(range(3, 40))
    _, plain = study.score(model, ids)
    kv = study.KVRounding()
    kv.install(model)
    kv.collect = True
    study.score(model, list(range(5, 60)))
    for variant in ("kv-none", "kv-none-hadamard", "kv-none-centered-hadamard"):
        kv.set(variant)
        _, logits = study.score(model, ids)
        assert torch.allclose(logits, plain, atol=1e-4), variant
    kv.set("kv-e5m2")
    _, rounded = study.score(model, ids)
    assert not torch.allclose(rounded, plain, atol=1e-4)


def test_a_run_reports_each_variant(study, tiny_llama_gqa, tmp_path):
    out = tmp_path / "study.json"
    variants = ["fp8-channel", "fp8-gptq-calibration", "kv-e5m2-centered-hadamard"]
    argv = ["--model", tiny_llama_gqa[0], "--variants", *variants, "--text-tokens", "64"]
    assert study.main([*argv, "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["text_tokens"] == 64 and list(report["variants"]) == variants
    for entry in report["variants"].values():
        assert 0.0 <= entry["top1_agreement"] <= 1.0 and entry["perplexity_ratio"] > 0
        assert entry["logit_rms_error"] > 0  # each of them rounds something
