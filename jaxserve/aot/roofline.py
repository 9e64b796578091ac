"""Speed on paper: a roofline time for a step and a projected throughput from it.

A step cannot run faster than its FLOPs at the chip's peak FLOP/s nor than its bytes at the chip's
HBM bandwidth: its roofline time is the larger of the two (bf16 peak: int8 weights are widened
before their matmuls). The counts are per device, from the model's own sharded weights
(compile_check.weight_roles) and KV pool, for the padded bucket the engine would run:

- bytes: every weight a step uses, read once (the embedding table only by its gathered rows; of
  the experts, the expected share that at least one token of the step routes to; every LoRA
  adapter slot), plus the KV of every sequence's context, read once by the attention kernel;
- FLOPs: 2 per matrix element per token (experts: top_k of num_experts per token; LoRA: one
  adapter's slot per token; the head: the sampled rows only), plus the attention's score and
  value products (4 x context x head_dim per query row and head).

XLA's own cost analysis is kept in the reports but not used here: it does not see inside the
Pallas kernel and counts the layer loop's body once. The result is a best case: no host time,
no kernel below its roofline, no overlap of prefill with decode; real throughput is lower. It is
an estimate, and every table made from it says so. Under pipeline parallelism a device computes its
stage's layers; a decode step's stages run one after another (one batch in the pipeline), a
prefill chunk's M microbatches pass the S stages in M + S - 1 ticks of one microbatch's time
(layers/pipeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.aot.compile_check import Report
from jaxserve.chips import Chip
from jaxserve.layers.pipeline import num_microbatches


@dataclass(frozen=True)
class Workload:
    """Requests of `input_len` prompt and `output_len` generated tokens, all at once."""

    input_len: int
    output_len: int


def seconds(flops: float, nbytes: float, chip: Chip) -> float:
    """The roofline time of `flops` and `nbytes` of HBM traffic on one chip."""
    return max(flops / chip.bf16_flops, nbytes / chip.hbm_bandwidth)


def step_cost(
    report: Report, bucket: tuple[int, int], sequences: float, queries: int, context: float
) -> tuple[float, float]:
    """(flops, bytes) on one device of a step in `bucket` (its padded tokens and sampled rows are
    all computed) over `sequences` real sequences, whose `queries` real tokens each attend to
    `context` tokens on average; each sequence's context is read once."""
    w, s = report.weights, report.shape
    tokens, rows = bucket
    expert_share = s["top_k"] / s["num_experts"] if s["num_experts"] else 0.0
    touched = 1.0 - (1.0 - expert_share) ** queries  # the experts some token of the step routes to
    lora = w.get("lora", {"bytes": 0, "elements": 0})  # every slot read; a token multiplies by one
    nbytes = w["dense"]["bytes"] + w["head"]["bytes"] + touched * w["experts"]["bytes"] + lora["bytes"]
    nbytes += (sequences * context + queries) * s["kv_bytes_per_token"]  # read, and the new tokens' written
    matmul = tokens * (w["dense"]["elements"] + expert_share * w["experts"]["elements"])
    matmul += tokens * lora["elements"] / max(1, report.max_loras)
    flops = 2.0 * (matmul + rows * w["head"]["elements"])
    heads = s["num_heads"] / report.tensor_parallel_size
    layers = s["num_layers"] / report.pipeline_parallel_size  # a device's stage of them
    flops += 4.0 * queries * context * heads * s["head_dim"] * layers
    return flops, nbytes


def project(report: Report, chip: Chip, workload: Workload) -> dict | None:
    """The projected steady throughput of `workload` on the report's configuration: as many
    requests at once as the KV pool and max_num_seqs allow, each wave prefilled in chunks of the
    largest token bucket, then decoded one token per step. None when the requests do not fit
    max_model_len."""
    per_request = workload.input_len + workload.output_len
    if per_request > report.max_model_len or not report.buckets:
        return None
    batch = min(report.buckets[-1][1], report.kv_tokens // per_request)
    if batch < 1:
        return None
    decode_bucket = next(b for b in report.buckets if b[0] >= batch and b[1] >= batch)
    chunk = report.buckets[-1][0]
    context = workload.input_len + workload.output_len / 2  # the average over the decode steps
    decode_flops, decode_bytes = step_cost(report, decode_bucket, batch, batch, context)
    # one batch in the pipeline at a time: its stages run one after another (the head counted in each)
    stages = report.pipeline_parallel_size
    decode_s = stages * seconds(decode_flops, decode_bytes, chip)
    # a chunk of prompt tokens attends, on average, to half a prompt; it spans chunk/input_len prompts
    spanned = max(1.0, chunk / workload.input_len)
    micro = num_microbatches(chunk, report.pipeline_microbatch_tokens, stages)
    rows, size = report.buckets[-1][1], chunk // micro  # (the head's rows counted in each microbatch)
    chunk_flops, chunk_bytes = step_cost(report, (size, rows), spanned / micro, size, workload.input_len / 2)
    chunk_s = (micro + stages - 1) * seconds(chunk_flops, chunk_bytes, chip)
    prefill_s = -(-batch * workload.input_len // chunk) * chunk_s
    wave_s = prefill_s + workload.output_len * decode_s
    return {
        "concurrency": batch,
        "decode_bucket": list(decode_bucket),
        "decode_step_ms": decode_s * 1e3,
        "decode_bound": "memory" if decode_bytes / chip.hbm_bandwidth > decode_flops / chip.bf16_flops else "compute",
        "prefill_chunk_ms": chunk_s * 1e3,
        "wave_s": wave_s,
        "output_tok_s": batch * workload.output_len / wave_s,
        "req_s": batch / wave_s,
        "ttft_s_first_wave": prefill_s,
    }  # fmt: skip
