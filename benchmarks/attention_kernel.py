"""Ragged paged attention microbenchmark: one attention call on a decode batch and on a mixed
batch (decodes plus prefill chunks), for any backend of layers/attention.py.

Reports the time per call, the KV bytes the call must read (every cached token of every
sequence, keys and values of every KV head, once) per second, and that rate's share of the
device's peak memory bandwidth (--peak-gbps, or known from the device kind; for a TPU
missing from the table, Pallas' facts about the chip). The default shapes are Llama-3-8B's
attention (32 query heads, 8 KV heads, head_dim 128) over 64 sequences of 2k context, in
bfloat16.

    python benchmarks/attention_kernel.py [--backend auto|reference|pallas|pallas-tpu-interpret|...]
        [--num-seqs 64] [--context-len 2048] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import numpy as np

# Peak HBM bandwidth in GB/s by device kind (as jax names it), for the share of peak.
PEAK_GBPS = {
    "NVIDIA H200": 4800.0,
    "NVIDIA H100 80GB HBM3": 3350.0,
    "NVIDIA A100-SXM4-80GB": 2039.0,
    "TPU v5 lite": 819.0,
    "TPU v5p": 2765.0,
    "TPU v4": 1200.0,
    "TPU v6 lite": 1640.0,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/attention_kernel.py",
        description="Time one ragged paged attention call on decode and mixed batches.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backend", default="auto", help="--attention-backend value.")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--context-len", type=int, default=2048, help="Cached tokens per sequence.")
    p.add_argument(
        "--prefill-len", type=int, default=512, help="New tokens of each prefill in the mixed batch."
    )
    p.add_argument("--num-prefills", type=int, default=4, help="Sequences of the mixed batch that prefill.")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--peak-gbps", type=float, default=None, help="Peak memory bandwidth; default by device kind."
    )
    p.add_argument("--output-json", default=None)
    return p


def make_batch(ns, mixed: bool, rng: np.random.Generator):
    """(kernel inputs, KV bytes the call reads): every sequence has context_len cached tokens
    and one new token; in the mixed batch the first num_prefills prefill prefill_len tokens."""
    import jax.numpy as jnp

    n, page = ns.num_seqs, ns.page_size
    q_lens = np.ones(n, np.int32)
    if mixed:
        q_lens[: ns.num_prefills] = ns.prefill_len
    kv_lens = (ns.context_len + q_lens).astype(np.int32)
    pages_per_seq = -(-int(kv_lens.max()) // page)
    num_pages = 1 + n * pages_per_seq
    dtype = jnp.dtype(ns.dtype)
    kv = jnp.asarray(
        rng.standard_normal((num_pages, 2 * ns.num_kv_heads, page, ns.head_dim), np.float32), dtype
    )
    page_indices = (1 + rng.permutation(n * pages_per_seq)).reshape(n, pages_per_seq).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(cu[-1]), ns.num_q_heads, ns.head_dim), np.float32), dtype)
    kv_bytes = int(kv_lens.sum()) * 2 * ns.num_kv_heads * ns.head_dim * dtype.itemsize
    inputs = (
        q,
        kv,
        jnp.asarray(kv_lens),
        jnp.asarray(page_indices),
        jnp.asarray(cu),
        jnp.asarray([n], jnp.int32),
    )
    return inputs, kv_bytes


def time_call(fn, inputs, iters: int) -> float:
    """Median seconds per call, after one call to compile."""
    fn(*inputs).block_until_ready()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(*inputs).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    import jax

    from jaxserve.layers.attention import _kernel, resolve_attention_backend

    device = jax.devices()[0]
    try:
        backend = resolve_attention_backend(ns.backend, device.platform)
    except ValueError as e:
        print(f"kernels: error: {e}", file=sys.stderr)
        return 2
    kernel = _kernel(backend)
    fn = jax.jit(lambda *a: kernel(*a, sm_scale=ns.head_dim**-0.5))
    peak = ns.peak_gbps or PEAK_GBPS.get(device.device_kind)
    if peak is None and device.platform == "tpu":  # a TPU newer than the table: ask Pallas
        from jax.experimental.pallas import tpu as pltpu

        info = pltpu.get_tpu_info()
        peak = info.mem_bw_bytes_per_second * info.num_cores / 1e9
    rng = np.random.default_rng(0)
    report = {
        "config": {**vars(ns), "device_kind": device.device_kind, "backend_traced": backend},
        "results": {},
    }
    for name, mixed in (("decode", False), ("mixed", True)):
        inputs, kv_bytes = make_batch(ns, mixed, rng)
        seconds = time_call(fn, inputs, ns.iters)
        gbps = kv_bytes / seconds / 1e9
        row = {"seconds": seconds, "kv_bytes": kv_bytes, "kv_gbps": gbps, "tokens": int(inputs[0].shape[0])}
        row["share_of_peak_bandwidth"] = gbps / peak if peak else None
        report["results"][name] = row
        share = f", {100 * gbps / peak:.1f}% of {peak:.0f} GB/s peak" if peak else ""
        print(
            f"{name}: {seconds * 1e3:.3f} ms per call, KV read {gbps:.1f} GB/s{share} ({backend}, {device.device_kind})"
        )
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
