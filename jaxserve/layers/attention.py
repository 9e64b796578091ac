"""The attention models call: writes the step's keys and values into the paged pool, then
runs ragged paged attention with the backend chosen for the platform.

Every backend has the reference's signature (pallas_kernels/ragged_paged_attention/): the
pure-jnp reference (CPU: with a native kernel for steps of few rows), the Pallas TPU kernel and
the Pallas GPU kernel, the last two also in Pallas' interpret mode for checking them on any
machine. Which one runs is a static field
of the AttentionMetadata the runner builds (its `backend`): part of the pytree's structure, so
a step traced for one backend is never reused for another, and models never name a backend,
they pass the metadata through.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxserve.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES
from jaxserve.sharding import logical_to_spec
from pallas_kernels.ragged_paged_attention import cpu

_KERNEL_PLATFORMS = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu"}


def resolve_attention_backend(requested: str, platform: str) -> str:
    """--attention-backend on this platform -> the backend traced: "reference", "tpu",
    "gpu", "tpu-interpret" or "gpu-interpret". ValueError (one line) for a kernel the
    platform has none of."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {requested!r}."
        )
    kernel = _KERNEL_PLATFORMS.get(platform)
    if requested == "auto":
        return kernel or "reference"
    if requested == "pallas":
        if kernel is None:
            raise ValueError(
                f"--attention-backend pallas needs a TPU or GPU; this platform is {platform!r} "
                "(use reference, or pallas-tpu-interpret / pallas-gpu-interpret to run a kernel interpreted)."
            )
        return kernel
    return requested.removeprefix("pallas-")


def check_page_size(backend: str, page_size: int, dtype) -> None:
    """ValueError (one line) for a --block-size the backend's kernel cannot tile."""
    if backend.startswith("tpu"):
        from pallas_kernels.ragged_paged_attention.tpu import sublane_rows

        rows = sublane_rows(dtype)
        if page_size % rows:
            raise ValueError(
                f"--block-size {page_size} does not suit the TPU attention kernel with "
                f"{jnp.dtype(dtype).name} KV pages: it must be a multiple of {rows}."
            )


def default_block_size(backend: str, kv_cache_dtype: str) -> int:
    """--block-size when unset: 16, or on TPU the packed sublane tile of 1-byte pages (32)."""
    if backend.startswith("tpu") and kv_cache_dtype in KV_CACHE_DTYPES:
        from pallas_kernels.ragged_paged_attention.tpu import sublane_rows

        return max(16, sublane_rows(KV_CACHE_DTYPES[kv_cache_dtype]))
    return 16


def pool_head_dim(backend: str, head_dim: int) -> int:
    """head_dim of the KV pool: on TPU rounded up to whole 128-lane rows. A TPU lays out an
    array's last dimension in tiles of 128 lanes, so a pool of head_dim 64 would take the
    memory of 128 anyway; padding it in the shape makes the memory accounting true and hands
    the kernel lane-dense tiles. GPUs and CPUs store head_dim as it is."""
    if not backend.startswith("tpu"):
        return head_dim
    from pallas_kernels.ragged_paged_attention.tpu import LANES

    return -(-head_dim // LANES) * LANES


@functools.cache
def _kernel(name: str):
    """The attention function of backend `name`; a kernel's module is imported only when a
    backend names it."""
    if name == "reference":  # on a CPU, the native kernel for steps of few rows (cpu.py)
        return cpu.ragged_paged_attention
    platform, _, mode = name.partition("-")
    if platform == "tpu":
        from pallas_kernels.ragged_paged_attention import tpu as module
    else:
        from pallas_kernels.ragged_paged_attention import gpu as module
    return functools.partial(module.ragged_paged_attention, interpret=mode == "interpret")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # [num_tokens] int32, slot within one layer's pages; padding >= pool size
    kv_lens: jax.Array  # [max_num_seqs] int32, tokens in cache after this step
    page_indices: jax.Array  # [max_num_seqs, pages_per_seq] int32, pages within one layer
    cu_q_lens: jax.Array  # [max_num_seqs + 1] int32
    num_seqs: jax.Array  # [1] int32
    # The kernel to trace (a resolve_attention_backend result). Static, so part of the pytree's
    # structure: jit traces again for another backend instead of reusing the first trace.
    backend: str = field(metadata=dict(static=True))
    # [num_layers, 2] float32, each layer's key and value scale, for a pool of quantized pages
    # (int8, fp8); None for pages in the model's dtype. Fixed at start-up, sent with every step.
    kv_scales: jax.Array | None = None
    # Under a pipeline, the rows below which a microbatch costs a stage its weights' read time
    # (layers/pipeline.py); 0: the step goes through the stages as one batch. Static, as the backend.
    microbatch_tokens: int = field(default=0, metadata=dict(static=True))


def paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    kv_pool: jax.Array,  # [num_layers * pages_per_layer, 2 * num_kv_heads, page_size, head_dim]
    layer: jax.Array,  # [] int32
    pages_per_layer: int,
    meta: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,  # traced: a per-layer choice (see the reference)
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:  # ([num_tokens, num_q_heads, head_dim], kv_pool)
    page_offset = layer * pages_per_layer
    k_scale = v_scale = None
    if meta.kv_scales is not None:
        k_scale, v_scale = meta.kv_scales[layer, 0], meta.kv_scales[layer, 1]
    page_size = kv_pool.shape[2]
    head_dim = q.shape[-1]
    if kv_pool.shape[-1] > head_dim:  # a padded pool (pool_head_dim): zeros change no score
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, kv_pool.shape[-1] - head_dim)))  # noqa: E731
        q, k, v = pad(q), pad(k), pad(v)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    slots = meta.slot_mapping + page_offset * page_size
    kv_pool = per_device_heads(cpu.write_kv, (kv_pool, k, v), (slots,), scales)
    kernel = functools.partial(_kernel(meta.backend), sm_scale=sm_scale, soft_cap=soft_cap)
    metadata = (meta.kv_lens, meta.page_indices + page_offset, meta.cu_q_lens, meta.num_seqs)
    out = per_device_heads(kernel, (q, kv_pool), metadata, {"sliding_window": sliding_window, **scales})
    return out[..., :head_dim], kv_pool


def per_device_heads(fn, split: tuple, whole: tuple, scalars: dict) -> jax.Array:
    """`fn(*split, *whole, **scalars)` run on each device's own heads under tensor parallelism:
    the `split` arrays (query heads, KV heads, the pool's pages) divided over the "model" axis on
    their axis 1 (a KV head's query heads on its device), the `whole` ones and the traced scalars
    on every device whole, and the result split like the first. Written by hand for every backend,
    since XLA can partition neither a Pallas kernel's custom call nor, without gathering the
    whole pool on every device, the pool's writes and reads through its flattened pages."""
    mesh = jax.sharding.get_abstract_mesh()  # the mesh the step is traced under, if any
    axis = logical_to_spec(("kv_combined_heads",))[0]
    if mesh.empty or mesh.shape.get(axis, 1) == 1:
        return fn(*split, *whole, **scalars)
    heads, replicated = PartitionSpec(None, axis), PartitionSpec()
    traced = {k: v for k, v in scalars.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in scalars.items() if k not in traced}  # None, numbers: closed over

    def local(split, whole, traced):
        return fn(*split, *whole, **traced, **static)

    specs = (tuple(heads for _ in split), tuple(replicated for _ in whole), {k: replicated for k in traced})
    # (the kernels declare their outputs without how they vary over the mesh: no check of that)
    sharded = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)
    return sharded(split, whole, traced)


def sequence_attention(
    q: jax.Array,  # [num_tokens, num_heads, head_dim]
    k: jax.Array,  # [num_tokens, num_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_heads, head_dim]
    cu_q_lens: jax.Array,  # [num_seqs + 1] int32, sequence i's tokens are [cu[i], cu[i + 1])
    sm_scale: float,
    positions: jax.Array | None = None,  # [num_tokens] int32, with `window`
    window: int | jax.Array | None = None,  # a key further than this from the query's position is out
) -> jax.Array:  # [num_tokens, num_heads, head_dim]
    """An encoder's attention (BERT): every token attends to every token of its own sequence in
    the batch (within `window` positions of its own, ModernBERT's local layers), none of
    another's, in float32. Dense over the step's tokens ([heads, tokens, tokens] scores): an
    encoder's prompts are whole in one step, and it keeps no KV. Padding tokens attend among
    themselves (their rows are dropped)."""
    n = q.shape[0]
    seq = jnp.searchsorted(cu_q_lens, jnp.arange(n), side="right")
    scores = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * sm_scale
    seen = seq[:, None] == seq[None, :]
    if window is not None:
        seen &= jnp.abs(positions[:, None] - positions[None, :]) <= window
    scores = jnp.where(seen[None], scores, -jnp.inf)
    out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v.astype(jnp.float32))
    return out.astype(q.dtype)
