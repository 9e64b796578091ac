"""Ragged paged attention for NVIDIA GPUs: Pallas kernels lowered through Triton.

Same contract as reference.py (signature, KV layout, ragged batch, padding rows zero,
sliding window as a Python int, None or a traced int32 scalar, soft cap); the extra
keyword arguments only tune tile sizes and launch parameters.

## Two launches

The Triton backend has static grids and no scalar prefetch, so each launch covers an upper
bound of the work and its programs read their share of the batch from small int32 tables
built here in plain JAX (a few ops over [max_num_seqs] arrays).

1. Decode (sequences with one new token), split-K. Grid (max_num_seqs, num_kv_heads,
   num_kv_splits). Program (s, h, k) takes the q heads of kv head h for sequence s as the
   rows of one tile ([decode_rows, head_dim_p], decode_rows = max(16, group_p), powers of
   two: Triton's dot wants at least 16 rows) and the k-th of num_kv_splits
   equal slices of the keys the token can see. It writes its unnormalised partial
   (row max m, row sum l, accumulator acc) in float32; `_combine_splits` merges the
   slices in plain JAX:
       m* = max_k m_k,  w_k = 2^(m_k - m*),  out = sum_k w_k acc_k / sum_k w_k l_k.
   Slots that are not decodes (prefill, padding) find zero keys and exit at once.

2. Prefill chunks (q_len > 1). Grid (max_q_blocks, num_kv_heads). A q block is up to
   block_q consecutive new tokens of one sequence; with the group's q heads (padded to
   group_p, a power of two) it forms one tile of prefill_block_m = block_q * group_p rows
   (row r: token r // group_p, q head r % group_p), so every key and value tile is read
   once for all q heads of its kv head. The block visits keys from the first any of its
   rows can see (window) to its last token (causality) and stores its normalised rows
   straight into the output, which already holds the decode rows (input/output alias).
   max_q_blocks = cdiv(num_tokens, block_q) + min(max_num_seqs, num_tokens // 2) bounds
   the blocks of any batch (each prefill sequence adds at most one partial block and
   holds at least two tokens); programs past the batch's blocks exit at once.

Both run the same inner loop (`_attend`): per step, block_k keys whose page ids come from
the page table (key t of the sequence lives at page page_indices[seq, t // page_size],
slot t % page_size), gathered from the whole kv_pages ref by index with masked loads;
scores in float32, online softmax in base 2 (log2(e) folded into the scale), causal and
sliding-window masks, soft cap, p cast to the KV dtype for the second matmul. Quantized pages
(int8, fp8) are loaded as they are and cast to q's dtype, which both products then use; their
scales are folded into q and the output outside the kernels (reference.py, "Quantized pages").

## Tiles

Defaults are starting points for Hopper (H100 / H200), not yet tuned on hardware:
block_k = 64 keys per step (a bfloat16 K and V tile of 64 x 128 is 32 KiB, double
buffered with num_stages = 2); prefill tiles of 128 rows with 8 warps (the float32
accumulator 128 x 128 is 64 registers a thread), decode tiles of 16 rows with 4 warps
(decode is bound by the KV read); num_kv_splits from the shapes (`_auto_splits`: about two
programs per SM when few sequences decode).

## GPU constraints

Every in-kernel array has power-of-two dimensions: head_dim and group are padded to powers
of two inside the kernel with masked loads (padding reads zeros and is never stored),
block_k and the row counts are powers of two, and dots have at least 16 rows and
columns. The masked lanes of the prefill launch's store are aimed at a spare output row
(sliced off at the end), never at a row another lane stores: a GPU skips masked lanes, but
interpret mode writes back what they read, which must not race with a real store.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention.reference import fold_scales, is_quantized

LOG2E = math.log2(math.e)
H200_SMS = 132  # streaming multiprocessors: the auto split count aims for >= 2 programs each
MAX_KV_SPLITS = 16


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _lanes(size: int, n: int, axis: int):
    """Indices 0..size-1 along `axis` of a 2-D tile for an array dimension of n <= size:
    (index clamped into the array, in-range mask). Without padding (size == n) the mask is
    None and the index a plain range, so Triton sees contiguous, vectorisable addresses."""
    i = jax.lax.broadcasted_iota(jnp.int32, (size, 1) if axis == 0 else (1, size), axis)
    return (i, None) if size == n else (jnp.minimum(i, n - 1), i < n)


def _all(*masks):
    """Conjunction of the masks that are not None (None if all are)."""
    masks = [m for m in masks if m is not None]
    return functools.reduce(jnp.logical_and, masks) if masks else None


def _load(ref, mask):
    # The fill value in the ref's own kind: Triton casts no integer constant to fp8.
    fill = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.0
    return plgpu.load(ref, mask=mask, other=None if mask is None else fill)


def _compute_dtype(q_ref, kv_ref):
    """The dtype of both products: the pages' own, or q's when the pages are quantized (int8,
    fp8: cast up after the load, their scales folded outside, reference.fold_scales)."""
    return q_ref.dtype if is_quantized(kv_ref.dtype) else kv_ref.dtype


def _attend(
    q,  # [rows, head_dim_p] in the products' dtype (_compute_dtype)
    q_pos,  # [rows] int32, position of each row's token; -1: the row sees nothing
    start,  # [] int32, first key visited (a multiple of block_k)
    num_steps,  # [] int32, key blocks visited
    kv_end,  # [] int32, keys at or past this are never loaded
    seq,  # [] int32, slot of the sequence in the page table
    head,  # [] int32, kv head
    pages_ref,  # [max_num_seqs, pages_per_seq] int32
    kv_ref,  # [num_pages, 2 * num_kv_heads, page_size, head_dim]
    window,  # [] int32 or None
    *,
    block_k: int,
    head_dim: int,
    sm_scale: float,
    soft_cap: float | None,
):  # -> m [rows] (base 2), l [rows], acc [rows, head_dim_p], all float32
    rows, head_dim_p = q.shape
    page_size = kv_ref.shape[2]
    pages_per_seq = pages_ref.shape[1]
    cols, col_ok = _lanes(head_dim_p, head_dim, axis=1)  # [1, head_dim_p]

    def step(i, carry):
        m, l_sum, acc = carry
        t = start + i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k] key positions
        live = t < kv_end
        slot = jnp.minimum(jax.lax.div(t, page_size), pages_per_seq - 1)
        page = plgpu.load(pages_ref.at[seq, slot], mask=live, other=0)  # [block_k]
        idx = (page[:, None], 2 * head, jax.lax.rem(t, page_size)[:, None], cols)
        mask = _all(live[:, None], col_ok)  # [block_k, 1 or head_dim_p]
        k = _load(kv_ref.at[idx], mask).astype(q.dtype)  # [block_k, head_dim_p]
        v = _load(kv_ref.at[idx[0], idx[1] + 1, idx[2], idx[3]], mask).astype(q.dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if soft_cap is None:
            s = s * (sm_scale * LOG2E)  # [rows, block_k]
        else:
            s = (soft_cap * LOG2E) * jnp.tanh(s * (sm_scale / soft_cap))
        seen = t[None, :] <= q_pos[:, None]
        if window is not None:
            seen &= t[None, :] > q_pos[:, None] - window
        s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [rows]
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet
        p = jnp.exp2(s - m_safe[:, None])
        alpha = jnp.exp2(m - m_safe)
        l_sum = alpha * l_sum + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return m_new, l_sum, alpha[:, None] * acc + pv

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim_p), jnp.float32),
    )
    return jax.lax.fori_loop(0, num_steps, step, init)


def _decode_kernel(
    q_ref,  # [num_tokens, num_kv_heads, group, head_dim]
    kv_ref,  # [num_pages, 2 * num_kv_heads, page_size, head_dim]
    pages_ref,  # [max_num_seqs, pages_per_seq] int32
    lens_ref,  # [max_num_seqs] int32: kv_len of decode slots, 0 elsewhere
    rows_ref,  # [max_num_seqs] int32: the slot's q row
    *rest,  # window_ref [1] int32 if windowed; acc_ref [rows, head_dim_p], m_ref, l_ref [rows]
    block_k: int,
    num_splits: int,
    sm_scale: float,
    soft_cap: float | None,
):
    window_ref, (acc_ref, m_ref, l_ref) = (rest[0], rest[1:]) if len(rest) == 4 else (None, rest)
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, _, group, head_dim = q_ref.shape
    rows, head_dim_p = acc_ref.shape
    kv_len = lens_ref[seq]
    window = None if window_ref is None else window_ref[0]

    # Keys this token sees, [lo, kv_len), cut into num_splits slices of whole key blocks.
    lo = 0 if window is None else jnp.maximum(kv_len - window, 0)
    lo = lo // block_k * block_k
    per_split = pl.cdiv(pl.cdiv(kv_len - lo, num_splits), block_k) * block_k
    start = lo + split * per_split
    end = jnp.minimum(start + per_split, kv_len)
    num_steps = jnp.maximum(pl.cdiv(end - start, block_k), 0)

    g, g_ok = _lanes(rows, group, axis=0)  # [rows, 1]: q head within the group
    d, d_ok = _lanes(head_dim_p, head_dim, axis=1)  # [1, head_dim_p]
    q = _load(q_ref.at[rows_ref[seq], head, g, d], _all(g_ok, d_ok)).astype(_compute_dtype(q_ref, kv_ref))
    q_pos = jnp.full((rows,), kv_len - 1, jnp.int32)
    m, l_sum, acc = _attend(
        q, q_pos, start, num_steps, end, seq, head, pages_ref, kv_ref, window,
        block_k=block_k, head_dim=head_dim, sm_scale=sm_scale, soft_cap=soft_cap,
    )  # fmt: skip
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l_sum


def _prefill_kernel(
    q_ref,  # [num_tokens, num_kv_heads, group, head_dim]
    kv_ref,  # [num_pages, 2 * num_kv_heads, page_size, head_dim]
    pages_ref,  # [max_num_seqs, pages_per_seq] int32
    kv_lens_ref,  # [max_num_seqs] int32
    blk_seq_ref,  # [max_q_blocks] int32: sequence slot of each q block
    blk_first_ref,  # [max_q_blocks] int32: first q row of the block
    blk_end_ref,  # [max_q_blocks] int32: end of the sequence's q rows (= first row: empty block)
    *rest,  # window_ref [1] int32 if windowed; out_in_ref (aliased to out_ref); out_ref
    block_q: int,
    group_p: int,
    block_k: int,
    sm_scale: float,
    soft_cap: float | None,
):
    window_ref, out_ref = (rest[0], rest[2]) if len(rest) == 3 else (None, rest[1])
    blk, head = pl.program_id(0), pl.program_id(1)
    num_tokens, _, group, head_dim = q_ref.shape
    head_dim_p = _pow2(head_dim)
    first, q_end = blk_first_ref[blk], blk_end_ref[blk]

    @pl.when(first < q_end)
    def _():
        seq = blk_seq_ref[blk]
        kv_len = kv_lens_ref[seq]
        window = None if window_ref is None else window_ref[0]
        r = jnp.arange(block_q * group_p, dtype=jnp.int32)  # [rows]
        tok = first + jax.lax.div(r, group_p)  # row r: token r // group_p, q head r % group_p
        q_pos = jnp.where(tok < q_end, kv_len - q_end + tok, -1)  # [rows]
        tok, g = tok[:, None], jax.lax.rem(r, group_p)[:, None]  # [rows, 1]
        g_ok = None if group == group_p else g < group
        g = g if group == group_p else jnp.minimum(g, group - 1)
        d, d_ok = _lanes(head_dim_p, head_dim, axis=1)  # [1, head_dim_p]
        ok = _all(tok < q_end, g_ok, d_ok)  # [rows, 1 or head_dim_p]
        q = _load(q_ref.at[jnp.minimum(tok, num_tokens - 1), head, g, d], ok)

        # Keys from the first the block's first token sees to its last token (inclusive).
        last = kv_len - q_end + jnp.minimum(first + block_q, q_end)  # exclusive
        lo = 0 if window is None else jnp.maximum(kv_len - q_end + first - window + 1, 0)
        lo = lo // block_k * block_k
        m, l_sum, acc = _attend(
            q.astype(_compute_dtype(q_ref, kv_ref)), q_pos, lo, pl.cdiv(last - lo, block_k), last, seq, head, pages_ref,
            kv_ref, window, block_k=block_k, head_dim=head_dim, sm_scale=sm_scale, soft_cap=soft_cap,
        )  # fmt: skip
        out = acc / jnp.where(l_sum > 0, l_sum, 1.0)[:, None]
        # Masked lanes (padding rows, heads, columns) all point at the spare row num_tokens.
        row = jnp.where(ok, tok, num_tokens)
        plgpu.store(out_ref.at[row, head, g, d], out.astype(out_ref.dtype), mask=ok)


def _auto_splits(max_num_seqs: int, num_kv_heads: int, max_kv_len: int, block_k: int) -> int:
    """Splits enough for ~2 programs per SM when few sequences decode, but never more
    than the key blocks of the longest possible context."""
    splits = 1
    while (
        splits < MAX_KV_SPLITS
        and max_num_seqs * num_kv_heads * splits < 2 * H200_SMS
        and 2 * splits * block_k <= max_kv_len
    ):
        splits *= 2
    return splits


def _combine_splits(acc, m, l_sum):
    """acc [splits, seqs, kv_heads, rows, d], m / l [splits, seqs, kv_heads, rows] (m in
    base 2) -> [seqs, kv_heads, rows, d] float32; rows with no keys give zero."""
    m_max = jnp.max(m, axis=0)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp2(m - m_max)  # [splits, seqs, kv_heads, rows]
    l_tot = jnp.sum(w * l_sum, axis=0)
    acc = jnp.sum(w[..., None] * acc, axis=0)
    return acc / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]


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
    block_k: int = 64,
    prefill_block_m: int = 128,
    num_kv_splits: int | None = None,
    decode_num_warps: int = 4,
    prefill_num_warps: int = 8,
    num_stages: int = 2,
    interpret: bool = False,
    k_scale: float | jax.Array | None = None,  # quantized pages (reference.py, "Quantized pages")
    v_scale: float | jax.Array | None = None,
) -> jax.Array:  # [num_tokens, num_q_heads, head_dim]
    """block_k: keys per inner step (a power of two >= 16). prefill_block_m: rows of a
    prefill tile (q tokens x padded group; a power of two). num_kv_splits: decode split-K
    factor (a power of two; None: from the shapes, see `_auto_splits`)."""
    q, out_scale = fold_scales(q, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, combined, page_size, _ = kv_pages.shape
    num_kv_heads = combined // 2
    group = num_q_heads // num_kv_heads
    max_num_seqs, pages_per_seq = page_indices.shape
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    if prefill_block_m & (prefill_block_m - 1):
        raise ValueError(f"prefill_block_m must be a power of two, got {prefill_block_m}")
    group_p, head_dim_p = _pow2(group), _pow2(head_dim)
    decode_rows = max(16, group_p)
    block_q = max(1, prefill_block_m // group_p)
    while block_q * group_p < 16:  # dots want >= 16 rows
        block_q *= 2
    splits = num_kv_splits or _auto_splits(max_num_seqs, num_kv_heads, pages_per_seq * page_size, block_k)
    if splits & (splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two, got {splits}")

    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)  # free: q heads of kv head h adjacent
    seq_ids = jnp.arange(max_num_seqs, dtype=jnp.int32)
    q_lens = jnp.where(seq_ids < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [max_num_seqs]
    is_decode = q_lens == 1
    extra = []
    if sliding_window is not None:
        if not isinstance(sliding_window, jax.Array):  # fixed at trace time; huge: full attention
            sliding_window = min(int(sliding_window), jnp.iinfo(jnp.int32).max)
        extra = [jnp.asarray(sliding_window, jnp.int32).reshape(1)]
    whole = pl.no_block_spec

    # 1. Decodes, split-K: partials [splits, max_num_seqs, num_kv_heads, decode_rows(, head_dim_p)].
    part = lambda *tail: jax.ShapeDtypeStruct((splits, max_num_seqs, num_kv_heads, *tail), jnp.float32)  # noqa: E731
    acc, m, l_sum = pl.pallas_call(
        functools.partial(
            _decode_kernel, block_k=block_k, num_splits=splits, sm_scale=sm_scale, soft_cap=soft_cap
        ),
        grid=(max_num_seqs, num_kv_heads, splits),
        in_specs=[whole] * (5 + len(extra)),
        out_specs=[
            pl.BlockSpec((None, None, None, decode_rows, head_dim_p), lambda s, h, k: (k, s, h, 0, 0)),
            pl.BlockSpec((None, None, None, decode_rows), lambda s, h, k: (k, s, h, 0)),
            pl.BlockSpec((None, None, None, decode_rows), lambda s, h, k: (k, s, h, 0)),
        ],
        out_shape=[part(decode_rows, head_dim_p), part(decode_rows), part(decode_rows)],
        compiler_params=plgpu.CompilerParams(num_warps=decode_num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_decode",
    )(
        q4,
        kv_pages,
        page_indices,
        jnp.where(is_decode, kv_lens, 0),
        jnp.where(is_decode, cu_q_lens[:-1], 0),  # other slots' entries may be stale
        *extra,
    )
    acc, m, l_sum = acc[..., :group, :head_dim], m[..., :group], l_sum[..., :group]
    dec = _combine_splits(acc, m, l_sum)  # [max_num_seqs, num_kv_heads, group, head_dim]
    dec_rows = jnp.where(is_decode, cu_q_lens[:-1], num_tokens)  # non-decodes: to the spare row
    out = jnp.zeros((num_tokens + 1, num_kv_heads, group, head_dim), q.dtype)
    out = out.at[dec_rows].set(dec.astype(q.dtype))

    # 2. Prefill chunks: the table of q blocks (sequence, first row, end of its rows).
    max_q_blocks = pl.cdiv(num_tokens, block_q) + min(max_num_seqs, num_tokens // 2)
    blocks = jnp.where(q_lens > 1, pl.cdiv(q_lens, block_q), 0)  # [max_num_seqs]
    cum = jnp.cumsum(blocks)
    b = jnp.arange(max_q_blocks, dtype=jnp.int32)
    blk_seq = jnp.minimum(jnp.searchsorted(cum, b, side="right"), max_num_seqs - 1).astype(jnp.int32)
    blk_first = cu_q_lens[blk_seq] + (b - (cum[blk_seq] - blocks[blk_seq])) * block_q
    blk_end = jnp.where(b < cum[-1], cu_q_lens[blk_seq + 1], blk_first)
    out = pl.pallas_call(
        functools.partial(
            _prefill_kernel,
            block_q=block_q,
            group_p=group_p,
            block_k=block_k,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
        ),
        grid=(max_q_blocks, num_kv_heads),
        in_specs=[whole] * (8 + len(extra)),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        input_output_aliases={7 + len(extra): 0},
        compiler_params=plgpu.CompilerParams(num_warps=prefill_num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_prefill",
    )(q4, kv_pages, page_indices, kv_lens, blk_seq, blk_first, blk_end, *extra, out)
    out = out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim)
    return out if v_scale is None else (out.astype(jnp.float32) * out_scale).astype(q.dtype)
