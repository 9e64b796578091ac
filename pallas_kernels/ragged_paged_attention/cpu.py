"""Ragged paged attention on a CPU: the native kernel (cpu.cc) for steps of few query rows (over
float32 pages, or int8 / fp8 pages with their scales folded into q and the output as the
reference does), the pure-jnp reference for the rest. The same signature and values as
reference.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native
from pallas_kernels.ragged_paged_attention import reference

# Query rows up to which a step's attention runs natively: its cost grows with rows times context,
# the reference's with the chunks it loops over, which only pay off for prefill's many rows.
# Measured (SmolLM2's 9/3 heads of 64, float32 pages): decodes of 32 / 64 sequences at 256 keys
# 0.8 / 2.4 ms against XLA's 1.7-2.3 / 3.8-5.4; one prefill chunk at 2048 keys 5.4 ms at 32 rows,
# 10.8 at 64, 40 at 256 against XLA's ~14 for all three.
CPU_KERNEL_MAX_ROWS = 64


# Pages the kernel reads: float32 as they are, int8 and fp8 (a quantized pool) cast row by row.
PAGE_DTYPES = (jnp.float32, jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)


def kernel_applies(q: jax.Array, kv_pages: jax.Array) -> bool:
    """float32 rows, float32 or quantized pages, few rows, one CPU device."""
    if q.shape[0] > CPU_KERNEL_MAX_ROWS or q.dtype != jnp.float32:
        return False
    if not any(kv_pages.dtype == d for d in PAGE_DTYPES):
        return False
    return native.usable_in_trace()


def ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, 2 * num_kv_heads, page_size, head_dim]
    kv_lens: jax.Array,  # [max_num_seqs] int32
    page_indices: jax.Array,  # [max_num_seqs, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [max_num_seqs + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
) -> jax.Array:  # [num_tokens, num_q_heads, head_dim]
    if not kernel_applies(q, kv_pages):
        return reference.ragged_paged_attention(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    call = jax.ffi.ffi_call("jaxserve_ragged_paged_attention", out, vmap_method="sequential")
    q, out_scale = reference.fold_scales(q, k_scale, v_scale)  # the kernel reads the stored values
    out = call(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, window,
        sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
    )  # fmt: skip
    return out if v_scale is None else out * out_scale


def write_kv(
    kv_pages: jax.Array,  # [num_pages, 2 * num_kv_heads, page_size, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [num_tokens] int32: page * page_size + offset; >= num_slots drops
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
) -> jax.Array:  # [num_pages, 2 * num_kv_heads, page_size, head_dim]
    """reference.write_kv; fp8 pages on a CPU written in place by the native kernel instead, since
    XLA:CPU copies the whole pool around an fp8 write (twice per layer and step: a 0.7 GiB pool
    made a decode step of the default model take seconds)."""
    fp8 = jnp.issubdtype(kv_pages.dtype, jnp.floating) and reference.is_quantized(kv_pages.dtype)
    if not (fp8 and native.usable_in_trace()):
        return reference.write_kv(kv_pages, k, v, slot_mapping, k_scale, v_scale)
    rows, kv = reference.kv_rows(kv_pages, k, v, slot_mapping, k_scale, v_scale)
    out = jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype)
    call = jax.ffi.ffi_call("jaxserve_write_rows", out, input_output_aliases={0: 0})
    return call(kv_pages, rows.astype(jnp.int32), kv)
