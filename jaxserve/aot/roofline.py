"""Speed on paper: a roofline time for the compiled steps and a projected throughput from it.

A step cannot run faster than its FLOPs at the chip's peak FLOP/s nor than its bytes at the chip's
HBM bandwidth: its roofline time is the larger of the two. FLOPs and bytes come from XLA's cost
analysis of the compiled program, plus the attention kernel's own (XLA does not see inside a
Pallas kernel): reading each sequence's KV once per decode step, and the causal score and value
products. Both are per device (each holds 1/tp of the heads and weights). The result is a best
case: no host time, no kernel below its roofline, no overlap of prefill with decode; real
throughput is lower. It is an estimate, and every table made from it says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.aot.chips import Chip
from jaxserve.aot.compile_check import Program, Report


@dataclass(frozen=True)
class Workload:
    """Requests of `input_len` prompt and `output_len` generated tokens, all at once."""

    input_len: int
    output_len: int


def seconds(flops: float, nbytes: float, chip: Chip) -> float:
    """The roofline time of `flops` and `nbytes` of HBM traffic on one chip (bf16 peak)."""
    return max(flops / chip.bf16_flops, nbytes / chip.hbm_bandwidth)


def _plain(report: Report, bucket) -> Program | None:
    return next(
        (p for p in report.programs if p.bucket == tuple(bucket) and p.variant == "plain" and not p.error),
        None,
    )


def _attention(report: Report, queries: int, context: float) -> tuple[float, float]:
    """(flops, bytes) of the attention kernel on one device for `queries` rows over `context`
    keys each: the score and value products, and one read of that context's KV pages."""
    s = report.shape
    heads = s["num_heads"] / report.tensor_parallel_size
    flops = 4.0 * queries * context * heads * s["head_dim"] * s["num_layers"]
    return flops, context * s["kv_bytes_per_token"]


def project(report: Report, chip: Chip, workload: Workload) -> dict | None:
    """The projected steady throughput of `workload` on the report's configuration: as many
    requests at once as the KV pool and max_num_seqs allow, each wave prefilled in chunks of the
    largest token bucket, then decoded one token per step. None when the requests do not fit
    max_model_len or a needed program was not compiled."""
    per_request = workload.input_len + workload.output_len
    if per_request > report.max_model_len:
        return None
    seqs = report.buckets[-1][1]
    batch = min(seqs, report.kv_tokens // per_request)
    if batch < 1:
        return None
    decode_bucket = next(b for b in report.buckets if b[0] >= batch and b[1] >= batch)
    chunk_bucket = report.buckets[-1]
    decode, chunk = _plain(report, decode_bucket), _plain(report, chunk_bucket)
    if decode is None or chunk is None:
        return None
    context = workload.input_len + workload.output_len / 2  # the average over the decode steps
    attn_flops, attn_bytes = _attention(report, batch, context)
    decode_s = seconds(decode.flops + attn_flops, decode.bytes_accessed + batch * attn_bytes, chip)
    prompt_tokens = batch * workload.input_len
    chunks = -(-prompt_tokens // chunk_bucket[0])
    # causal: each prompt token attends to the half of its prompt before it, on average
    prefill_attn, _ = _attention(report, prompt_tokens, workload.input_len / 2)
    prefill_s = chunks * seconds(chunk.flops, chunk.bytes_accessed, chip) + prefill_attn / chip.bf16_flops
    wave_s = prefill_s + workload.output_len * decode_s
    return {
        "concurrency": batch,
        "decode_bucket": list(decode_bucket),
        "decode_step_ms": decode_s * 1e3,
        "decode_bound": "memory" if decode.bytes_accessed / chip.hbm_bandwidth > decode.flops / chip.bf16_flops else "compute",
        "prefill_chunk_ms": seconds(chunk.flops, chunk.bytes_accessed, chip) * 1e3,
        "wave_s": wave_s,
        "output_tok_s": batch * workload.output_len / wave_s,
        "req_s": batch / wave_s,
        "ttft_s_first_wave": prefill_s,
    }  # fmt: skip
