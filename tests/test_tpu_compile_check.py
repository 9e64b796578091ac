"""The server's step programs compile for TPU slices with libtpu's real compiler on this TPU-less
host (`jaxserve tpu-compile-check`), with the Pallas attention kernel in them, and fit the chip
the way the engine's own memory accounting says they do.

Each check runs the command in a subprocess: it points JAX and Pallas at a TPU target for its
whole life. A small Llama shape keeps each program to a few seconds of compiling; the whole-matrix
run over real model shapes is benchmarks/tpu_compile_matrix.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install -e '.[tpu]'); it is what compiles for a TPU",
)

SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SMALL = ["--max-num-batched-tokens", "64", "--max-num-seqs", "16", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    """A model as a configuration alone: the check reads no weight."""
    path = tmp_path_factory.mktemp("llama-shape")
    (path / "config.json").write_text(json.dumps(SHAPE))
    return str(path)


def compile_check(tmp_path, model: str, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "jaxserve.cli",
        "tpu-compile-check",
        "--model",
        model,
        *flags,
        "--json",
        str(out),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
    return done, (json.loads(out.read_text()) if out.exists() else {})


NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'
DRAFT = "draft"  # a draft model: the same shape (no weights either)


# served as a process reward model from the LM head's rows of two tokens: the pool_all kind's
# programs only (every token's row through that head, besides the rows' sums)
POOLING = "pooling"
# prompts given as embeddings: the quick scope adds the smallest program that takes their rows
EMBEDS = "embeds"


@pytest.mark.parametrize(
    "topology,tp,speculative",
    [
        ("v5e-4", 1, EMBEDS),
        ("v6e-4", 1, DRAFT),
        ("v6e-4", 4, None),
        ("v5e-4", 4, NGRAM),
        ("v6e-4", 4, POOLING),
    ],
)
def test_step_compiles_for_tpu_with_the_pallas_kernel(tmp_path, shape_dir, topology, tp, speculative):
    """With proposals (n-gram, or a draft model), the quick scope adds the smallest verify
    program: the proposed tokens as extra query rows through the kernel, and the sampler's
    every-row acceptance; and a draft model's own program."""
    flags = ["--topology", topology, "-tp", str(tp), *SMALL, "--programs", "quick"]
    pooling = speculative == POOLING
    if pooling:
        step = {"pooling_type": "STEP", "step_tag_id": 1, "returned_token_ids": [2, 3]}
        flags += ["--convert", "reward", "--pooler-config", json.dumps(step)]
        speculative = None
    embeds = speculative == EMBEDS
    if embeds:
        flags.append("--enable-prompt-embeds")
        speculative = None
    if speculative == DRAFT:
        speculative = json.dumps({"model": shape_dir, "num_speculative_tokens": 3})
    if speculative:
        flags += ["--speculative-config", speculative]
    done, report = compile_check(tmp_path, shape_dir, *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["attention_backend"] == "tpu" and report["dtype"] == "bfloat16"
    programs = report["programs"]
    expected = [((16, 16), "plain"), ((64, 16), "plain")] + [((16, 16), "verify")] * bool(speculative)
    if embeds:
        expected.append(((16, 16), "prompt_embeds"))
    if pooling:  # prompts pooled on the device: the pool kind, through the same kernel
        expected = [((16, 16), "pool_all"), ((64, 16), "pool_all")]
    if speculative and "model" in speculative:  # the draft's program; its pool from the same budget
        expected.append(((16, 16), "draft"))
        assert report["draft_weight_bytes"] == report["weight_bytes"]
        assert report["draft_kv_pool_bytes"] == report["kv_pool_bytes"]
        budget = report["hbm_bytes"] * report["gpu_memory_utilization"]
        assert 2 * (report["weight_bytes"] + report["kv_pool_bytes"]) <= budget
        assert " + draft model " in done.stdout and " + its pool " in done.stdout
    assert [(tuple(p["bucket"]), p["variant"]) for p in programs] == expected
    for p in programs:
        assert p["error"] is None
        assert p["kernels"] >= 1, "the step fell back from the Pallas kernel"
        assert 0 < p["peak_bytes"] <= report["hbm_bytes"]
        assert p["flops"] > 0 and p["bytes_accessed"] > 0
    # each device holds a quarter of the weights and of the pool at tp=4
    assert report["shape"]["kv_bytes_per_token"] == 2 * 2 * 128 * 2 * 4 / tp


def test_every_variant_compiles_with_quantized_weights_and_kv(tmp_path, shape_dir):
    """The sampler variants (penalties, top logprobs, prompt logprobs) and the structured-output
    pair (forward, then sampling under a token mask), with int8 weights, an int8 KV pool and
    LoRA adapter slots."""
    flags = ["--topology", "v5e-4", "-tp", "4", "-q", "int8", "--kv-cache-dtype", "int8"]
    flags += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
    small = ["--max-num-batched-tokens", "16", "--max-num-seqs", "16", "--max-model-len", "256"]
    done, report = compile_check(tmp_path, shape_dir, *flags, *small)
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["quantization"] == "int8" and report["kv_cache_dtype"] == "int8"
    # Each device's LoRA slots (2 layers x 2 slots x rank 16, float32): A of q|k|v and of gate|up
    # read the whole hidden state (512); A of o and down read their split inputs (1024 / 4); B's
    # outputs split like their projections' (q 1024, k and v 512, gate and up 1024 over 4 devices),
    # but o's and down's (the hidden state) whole.
    a = 512 * 3 + 1024 // 4 + 512 * 2 + 1024 // 4
    b = (1024 + 512 + 512 + 1024 + 1024) // 4 + 512 + 512
    lora = report["weights"]["lora"]
    assert report["max_loras"] == 2
    assert lora == {"elements": 2 * 2 * 16 * (a + b), "bytes": 4 * 2 * 2 * 16 * (a + b)}, lora
    parts = {(p["variant"], p["part"]) for p in report["programs"] if p["error"] is None}
    assert len(report["programs"]) == len(parts) == 8 * 1 + 8 * 2  # 16 variants, half of them in two parts
    assert ("plain", "step") in parts and ("token_bitmask", "sample") in parts
    assert ("processor_state+top_logprobs+prompt_logprobs+token_bitmask", "forward") in parts
    assert all(p["kernels"] >= 1 for p in report["programs"] if p["part"] != "sample")


def test_pipeline_stages_compile_for_tpu(tmp_path, shape_dir):
    """pp=2 x tp=4 on a v5e-8: the stages' step (each stage's layer in turn on its own four chips,
    through the Pallas kernel) and its verify program; each chip holds one stage's layers, so half
    the pool's bytes per token of tp=4 alone, and half of every layer stack. The 64-token step
    goes through the stages as two microbatches of 32, the 16-token ones as one batch."""
    microbatches = ["-O", json.dumps({"pipeline_microbatch_tokens": 32})]
    flags = ["--topology", "v5e-8", "-tp", "4", "-pp", "2", *SMALL, *microbatches, "--programs", "quick"]
    done, report = compile_check(tmp_path, shape_dir, *flags, "--speculative-config", NGRAM)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "v5e-8, tp=4 pp=2:" in done.stdout
    programs = report["programs"]
    assert [(tuple(p["bucket"]), p["variant"]) for p in programs] == [
        ((16, 16), "plain"),
        ((64, 16), "plain"),
        ((16, 16), "verify"),
    ]
    assert all(p["error"] is None and p["kernels"] >= 1 for p in programs)
    assert report["shape"]["kv_bytes_per_token"] == 2 * 2 * 128 * 2 * 4 / 4 / 2
    # q, k, v, o, gate, up, down of 2 layers in bf16: each chip a quarter of one layer's
    layer = 512 * 1024 + 2 * 512 * 512 + 1024 * 512 + 3 * 512 * 1024
    assert report["weights"]["dense"]["elements"] == layer // 4, report["weights"]


@pytest.mark.parametrize("tp,kv", [(1, "auto"), (4, "auto"), (1, "fp8")])
def test_engine_memory_accounting_matches_xla(tmp_path, shape_dir, tp, kv):
    """The KV pool the engine sizes for --gpu-memory-utilization fills the chip's share to within
    a block, XLA counts exactly the engine's weights and pool among a step's arguments (plus the
    batch's few arrays), the pool is updated in place (donated: the output aliases it), and the
    step's temporaries fit in the share of the chip the engine leaves free. Under tensor
    parallelism no device ever holds more than its own part of the pool (XLA gathered the whole
    pool onto every device to write a step's keys through the flattened pages, once), and an fp8
    pool is written in place (traced as for the host's CPU, its write went through a byte view
    that a TPU lays out differently: a copy of the whole pool)."""
    utilization = 0.01
    flags = [
        "--topology",
        "v5e-4",
        "-tp",
        str(tp),
        "--gpu-memory-utilization",
        str(utilization),
        "--kv-cache-dtype",
        kv,
        "--programs",
        "quick",
    ]
    # room for more pages than the budget holds: the budget, not max_num_seqs, sizes the pool
    sizes = ["--max-num-batched-tokens", "256", "--max-num-seqs", "256", "--max-model-len", "1024"]
    done, report = compile_check(tmp_path, shape_dir, *flags, *sizes)
    assert done.returncode == 0, done.stderr[-3000:]
    budget = utilization * report["hbm_bytes"]
    block = report["kv_pool_bytes"] / report["num_blocks"]
    held = report["weight_bytes"] + report["kv_pool_bytes"]
    assert budget - block < held <= budget
    for p in report["programs"]:
        inputs = p["argument_bytes"] - held  # the batch's arrays and the last sampled tokens
        assert 0 < inputs < 2**20, inputs
        assert p["alias_bytes"] >= report["kv_pool_bytes"]
        # what the step needs beyond the pool and weights fits in the share the engine leaves free
        assert 0 < p["peak_bytes"] - held <= (1 - utilization) * report["hbm_bytes"]
        assert p["temp_bytes"] < report["kv_pool_bytes"] / 4


def test_a_model_too_large_for_the_chip_is_one_line(tmp_path, shape_dir):
    done, report = compile_check(
        tmp_path, shape_dir, "--topology", "v5e-1", "--gpu-memory-utilization", "0.0001", *SMALL
    )
    assert done.returncode == 1
    assert report["refused"] and not report["programs"]
    lines = [line for line in done.stderr.splitlines() if "tp=1" in line]
    assert len(lines) == 1 and "KV cache" in lines[0], done.stderr[-2000:]


def test_a_model_that_does_not_split_is_one_line(tmp_path, shape_dir):
    done, report = compile_check(tmp_path, shape_dir, "--topology", "v5e-4", "-tp", "3", *SMALL)
    assert done.returncode == 1 and not report["programs"]
    assert "must be divisible by tensor_parallel_size (3)" in report["refused"]
    assert len([line for line in done.stderr.splitlines() if "tp=3" in line]) == 1, done.stderr[-2000:]


def test_unknown_topology_is_a_usage_error(tmp_path, shape_dir):
    done, _ = compile_check(tmp_path, shape_dir, "--topology", "v4-8")
    assert done.returncode == 2 and "--topology" in done.stderr


# Qwen2-VL's shape: the decoder above with M-RoPE sections (64 frequencies of a 128-wide head), a
# 4-layer ViT 256 wide with 8 heads over 14x14 patches of 2 frames, 2x2 merged into the decoder's width
QWEN2_VL_SHAPE = {
    **SHAPE,
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    "image_token_id": 1001,
    "video_token_id": 1002,
    "vision_start_token_id": 1003,
    "vision_config": {
        "embed_dim": 256, "depth": 4, "num_heads": 8, "mlp_ratio": 4, "patch_size": 14, "temporal_patch_size": 2,
        "spatial_merge_size": 2, "in_channels": 3, "hidden_size": 512, "hidden_act": "quick_gelu",
    },
}  # fmt: skip


@pytest.mark.parametrize("tp", [1, 4])
def test_a_vision_language_model_compiles_for_tpu(tmp_path, tp):
    """Qwen2-VL: its image encoder (the smallest patch bucket), the steps with M-RoPE positions,
    and the step that takes a prompt's image rows, each through libtpu; at tp=4 the encoder's
    heads are split like the decoder's."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_VL_SHAPE))
    flags = ["--topology", "v5e-4", "-tp", str(tp), *SMALL, "--programs", "quick"]
    done, report = compile_check(tmp_path, str(tmp_path), *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    programs = {(tuple(p["bucket"]), p["variant"]): p for p in report["programs"]}
    assert ((64, 14 * 14 * 2 * 3), "encoder") in programs
    assert any(variant == "prompt_embeds" for _, variant in programs), list(programs)
    assert all(p["error"] is None for p in programs.values())
    assert all(p["kernels"] >= 1 for (_, variant), p in programs.items() if variant != "encoder")
