"""The roofline projection's arithmetic (jaxserve/aot/roofline.py) against the textbook cases: a
decode step at batch 1 reads every weight once, an MoE decode reads only the routed experts, a
long prefill chunk is bound by its matmul FLOPs, and requests longer than the context get none."""

from __future__ import annotations

import pytest

from jaxserve.aot.compile_check import Report
from jaxserve.aot.roofline import Workload, project, step_cost
from jaxserve.chips import CHIPS

GB = 1e9


def llama_8b_like(experts: int = 0, top_k: int = 0, expert_bytes: float = 0.0) -> Report:
    """Llama-3.1-8B's per-device weights in bf16 on one chip (embedding untied)."""
    report = Report("llama", "v6e-1", 1, max_model_len=2048, kv_tokens=100_000)
    report.buckets = [(16, 16), (32, 32), (64, 64), (128, 128), (256, 256), (1024, 256)]
    report.shape = {"num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                    "kv_bytes_per_token": 131072.0, "num_experts": experts, "top_k": top_k}  # fmt: skip
    report.weights = {
        "embedding": {"bytes": 1.05 * GB, "elements": 0.525 * GB},
        "head": {"bytes": 1.05 * GB, "elements": 0.525 * GB},
        "dense": {"bytes": 13.96 * GB, "elements": 6.98 * GB},
        "experts": {"bytes": expert_bytes, "elements": expert_bytes / 2},
    }
    return report


def test_batch_one_decode_reads_the_weights_once_not_the_embedding_table():
    report, chip = llama_8b_like(), CHIPS["v6e"]
    flops, nbytes = step_cost(report, (16, 16), sequences=1, queries=1, context=0)
    assert nbytes == pytest.approx((13.96 + 1.05) * GB + 131072.0)
    assert nbytes / chip.hbm_bandwidth == pytest.approx(9.15e-3, rel=0.01)  # ~9 ms on a v6e
    assert flops / chip.bf16_flops < nbytes / chip.hbm_bandwidth  # memory-bound


def test_decode_reads_each_sequences_context_once():
    report = llama_8b_like()
    _, short = step_cost(report, (64, 64), sequences=50, queries=50, context=100)
    _, long = step_cost(report, (64, 64), sequences=50, queries=50, context=1100)
    assert long - short == pytest.approx(50 * 1000 * 131072.0)


def test_moe_decode_reads_only_the_routed_experts():
    report = llama_8b_like(experts=128, top_k=8, expert_bytes=50 * GB)
    _, one = step_cost(report, (16, 16), sequences=1, queries=1, context=0)
    _, many = step_cost(report, (256, 256), sequences=256, queries=256, context=0)
    dense = (13.96 + 1.05) * GB
    assert one - dense == pytest.approx(50 * GB * 8 / 128, rel=1e-3)  # one token: top_k experts
    assert many - dense == pytest.approx(50 * GB, rel=1e-3)  # 256 tokens touch them all


def test_a_long_prefill_chunk_is_compute_bound_at_two_flops_per_weight():
    report, chip = llama_8b_like(), CHIPS["v6e"]
    flops, nbytes = step_cost(report, (1024, 256), sequences=1, queries=1024, context=0)
    assert flops == pytest.approx(2 * (1024 * 6.98 + 256 * 0.525) * GB)
    assert flops / chip.bf16_flops > nbytes / chip.hbm_bandwidth


def test_projection_fills_the_kv_pool_and_counts_waves():
    report, chip = llama_8b_like(), CHIPS["v6e"]
    projected = project(report, chip, Workload(1800, 128))
    assert projected["concurrency"] == 100_000 // 1928 == 51
    assert projected["decode_bucket"] == [64, 64]
    wave = projected["ttft_s_first_wave"] + 128 * projected["decode_step_ms"] / 1e3
    assert projected["req_s"] == pytest.approx(51 / wave)
    assert projected["output_tok_s"] == pytest.approx(51 * 128 / wave)
    assert project(report, chip, Workload(2000, 128)) is None  # longer than max_model_len


def test_pipeline_microbatches_shorten_a_prefill_chunk_not_a_decode_step():
    """pp=2 on a v5e, a 2048-token chunk: with the chip's ridge (241 rows) the chunk passes as 8
    microbatches of 256 in 9 ticks, each an eighth of a stage's compute-bound chunk: 9/16 of the
    two stages' turns; a decode step's stages still take turns. On a v6e (ridge 560) the chunk
    passes as 4 microbatches of 512: below the ridge, a tick lasts the weights' read time."""
    workload = Workload(1800, 128)
    for chip, micro, ticks in ((CHIPS["v5e"], 8, 9), (CHIPS["v6e"], 4, 5)):
        turns, cut = llama_8b_like(), llama_8b_like()
        for report, ridge in ((turns, 0), (cut, round(chip.bf16_flops / chip.hbm_bandwidth))):
            report.buckets[-1] = (2048, 256)
            report.pipeline_parallel_size, report.pipeline_microbatch_tokens = 2, ridge
        one, many = project(turns, chip, workload), project(cut, chip, workload)
        assert one["decode_step_ms"] == many["decode_step_ms"]
        size, spanned = 2048 // micro, 2048 / 1800  # a chunk spans 2048 / 1800 prompts
        flops, nbytes = step_cost(cut, (size, 256), spanned / micro, size, 900)
        tick_s = max(flops / chip.bf16_flops, nbytes / chip.hbm_bandwidth)
        assert many["prefill_chunk_ms"] == pytest.approx(ticks * tick_s * 1e3)
        assert many["prefill_chunk_ms"] < 0.75 * one["prefill_chunk_ms"]
