"""Pure-jnp ragged paged attention: the reference every kernel is tested against, and the
path the engine runs on CPU.

## The KV layout (shared by the reference and every kernel)

    kv_pages: [num_pages, 2 * num_kv_heads, page_size, head_dim]

Page-major: one page holds `page_size` consecutive tokens of one sequence, for every KV
head, keys and values interleaved along the head axis as (k_0, v_0, k_1, v_1, ...).
Inside a page each (head, k|v) slice is a contiguous [page_size, head_dim] tile, so a
kernel copies one tile per head and page, and a gather of a sequence's pages yields
[heads, tokens, head_dim] with no transpose. Interleaving keeps a head's K and V in the
same shard when the head axis is split over a mesh, and one page holds both. The engine
stacks the pages of all layers into one pool (layer l owns pages [l * pages_per_layer,
(l+1) * pages_per_layer)) and offsets `page_indices` by layer, so this signature never
sees layers. On TPU the engine pads head_dim to a multiple of 128 lanes in the pool (a TPU
tiles memory by 128 lanes anyway) and pads q, k and v to match, so every function here sees
one head_dim.

## The ragged batch

The flat query batch holds the new tokens of `num_seqs` sequences back to back: sequence
i owns rows cu_q_lens[i]:cu_q_lens[i+1]. kv_lens[i] counts its tokens in the cache
*including* the new ones (which write_kv stored before attention runs), so the new
tokens sit at positions kv_lens[i] - q_len_i ... kv_lens[i] - 1 and attend causally to
everything up to and including themselves. Prefill chunks and decodes (q_len 1) mix
freely. Rows past cu_q_lens[num_seqs] are padding: their output is zero.

## How the reference stays fast on CPU

Two passes, each reading every needed key page once per unit of work:
- decode rows (sequences with one new token): one row per sequence, DECODE_GROUP
  sequences at a time, gathering each sequence's pages chunk by chunk;
- prefill rows: the new tokens of each longer sequence are cut into query blocks of
  BLOCK_Q rows, and what is left (fewer than BLOCK_Q) into blocks of TAIL_BLOCK_Q, so a short
  prompt's last block is not mostly padding; a block gathers its sequence's pages once for
  all its rows and stops at the last key its rows can see (causality), so prefill costs
  matmuls, not gathers. Blocks go ROWS_PER_STEP rows at a time in the order of the key chunks
  they need, so blocks handled together visit about as many chunks each (31 prompts of 133
  tokens: 47 -> 26 ms per layer on this CPU for SmolLM2's heads).
Both use an online softmax over key chunks of KV_CHUNK_TOKENS, so memory stays bounded
whatever the context length, and both loop only as far as the batch needs (and, under a
sliding window, start no earlier than the first key any of their rows can see).

## Options

- `sliding_window`: a query at position p sees keys at positions > p - sliding_window.
  Either a Python int (or None: no window) fixed at trace time, or a traced int32 scalar,
  which is how a model scanning over layers gives each layer its own window; a value no
  smaller than the context length means full attention.
- `soft_cap`: scores (already scaled) become soft_cap * tanh(score / soft_cap).

## Quantized pages

The pool may hold int8 or fp8 (float8_e4m3fn, float8_e5m2) pages with one scale for the keys
and one for the values of a layer (per-tensor): write_kv stores round(k / k_scale) (int8,
saturated at +-127) or k / k_scale saturated at the format's largest finite value (fp8, whose
casts would otherwise turn an overflow into NaN). Attention folds the scales into the math
instead of dequantizing pages: q . (k_scale k_q) = (k_scale q) . k_q, and softmax(s) .
(v_scale v_q) = v_scale (softmax(s) . v_q); so q is scaled once per row, the output once per
row, and every page is only cast. The kernels take the same `k_scale` / `v_scale` (a Python
float or a traced float32 scalar; None: 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.tracing import traced_platform

KV_CHUNK_TOKENS = 128  # keys per online-softmax step
BLOCK_Q = 64  # query rows per prefill block
TAIL_BLOCK_Q = 16  # query rows per block of a prefill's last rows (fewer than BLOCK_Q)
ROWS_PER_STEP = 256  # prefill query rows handled together in one loop iteration
DECODE_GROUP = 32  # decode sequences handled together in one loop iteration


def is_quantized(dtype) -> bool:
    """Whether pages of this dtype hold scaled integers or fp8 (not plain 16/32-bit floats)."""
    return jnp.dtype(dtype).itemsize == 1


def quantize(x: jax.Array, scale, dtype) -> jax.Array:
    """x / scale in the pages' int8 or fp8 dtype, saturated at its largest finite value."""
    x = x.astype(jnp.float32) / scale
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.clip(jnp.round(x), -127, 127).astype(dtype)
    largest = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -largest, largest).astype(dtype)


def fold_scales(q: jax.Array, k_scale, v_scale):
    """(q times k_scale, the output's factor): how attention over scaled pages stays exact
    without dequantizing them (see "Quantized pages")."""
    if k_scale is not None:
        q = (q.astype(jnp.float32) * k_scale).astype(q.dtype)
    return q, 1.0 if v_scale is None else v_scale


def kv_rows(
    kv_pages: jax.Array,  # [num_pages, 2 * num_kv_heads, page_size, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [num_tokens] int32: page * page_size + offset; >= num_slots drops
    k_scale: float | jax.Array | None = None,  # quantized pages: k is stored as k / k_scale
    v_scale: float | jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:  # ([num_tokens * 2 * num_kv_heads], [that many, head_dim])
    """What write_kv writes: the rows of the pool seen as [num_pages * 2 * num_kv_heads *
    page_size, head_dim] (a padding token's past the pool) and their values in its dtype."""
    num_pages, combined, page_size, head_dim = kv_pages.shape
    if is_quantized(kv_pages.dtype):
        k = quantize(k, 1.0 if k_scale is None else k_scale, kv_pages.dtype)
        v = quantize(v, 1.0 if v_scale is None else v_scale, kv_pages.dtype)
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0] * combined, head_dim).astype(kv_pages.dtype)
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    rows = (page[:, None] * combined + jnp.arange(combined)[None, :]) * page_size + offset[:, None]
    rows = jnp.where(page[:, None] < num_pages, rows, num_pages * combined * page_size)  # padding: dropped
    return rows.reshape(-1), kv


def write_kv(kv_pages, k, v, slot_mapping, k_scale=None, v_scale=None) -> jax.Array:
    """The pool with the step's keys and values written where kv_rows (same arguments) says."""
    rows, kv = kv_rows(kv_pages, k, v, slot_mapping, k_scale, v_scale)
    flat = kv_pages.reshape(-1, kv_pages.shape[-1])
    fp8 = jnp.issubdtype(kv_pages.dtype, jnp.floating) and is_quantized(kv_pages.dtype)
    if fp8 and traced_platform() == "cpu":
        # fp8 rows move as their bytes: XLA:CPU, with no fp8 scatter, would otherwise convert the
        # whole pool to float32 and back at every write; this still copies the pool twice (the
        # native write in cpu.py copies none; an int8 pool's write takes 0.01 ms).
        bits = jax.lax.bitcast_convert_type(flat, jnp.uint8)
        bits = bits.at[rows].set(jax.lax.bitcast_convert_type(kv, jnp.uint8), mode="drop")
        return jax.lax.bitcast_convert_type(bits, kv_pages.dtype).reshape(kv_pages.shape)
    flat = flat.at[rows].set(kv, mode="drop")
    return flat.reshape(kv_pages.shape)


def _attend_chunks(
    q: jax.Array,  # [units, num_kv_heads, rows, head_dim] float32, already scaled
    q_pos: jax.Array,  # [units, rows] int32, -1 for rows that see nothing
    pages: jax.Array,  # [units, pages_per_seq] int32, page table of each unit's sequence
    kv_pages: jax.Array,  # [num_pages, 2 * num_kv_heads, page_size, head_dim]
    num_chunks: jax.Array,  # [] int32, key chunks to visit (from the first)
    sliding_window: int | jax.Array | None,
    soft_cap: float | None,
) -> jax.Array:  # [units, num_kv_heads, rows, head_dim] float32
    units, num_kv_heads, rows, head_dim = q.shape
    num_pages, combined, page_size, _ = kv_pages.shape
    chunk_pages = max(1, KV_CHUNK_TOKENS // page_size)
    chunk = chunk_pages * page_size
    if pages.shape[1] % chunk_pages:
        # Pad the page table to whole chunks; the extra entries lie past every position.
        pages = jnp.pad(pages, ((0, 0), (0, chunk_pages - pages.shape[1] % chunk_pages)))
    tiles = kv_pages.reshape(num_pages * combined, page_size, head_dim)
    heads = 2 * jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
    batch = ((0, 1), (0, 1))

    def body(c, carry):
        m, l_sum, acc = carry
        chunk_ids = jax.lax.dynamic_slice_in_dim(pages, c * chunk_pages, chunk_pages, axis=1)
        k_tiles = chunk_ids[:, None, :] * combined + heads  # [units, num_kv_heads, chunk_pages]
        # Page ids are always valid (padding points at page 0): skipping the bounds clamp
        # halves the cost of the gather on XLA:CPU.
        k = tiles.at[k_tiles].get(mode="promise_in_bounds")
        v = tiles.at[k_tiles + 1].get(mode="promise_in_bounds")
        k = k.reshape(units, num_kv_heads, chunk, head_dim).astype(jnp.float32)
        v = v.reshape(units, num_kv_heads, chunk, head_dim).astype(jnp.float32)
        # Keys as the left operand: XLA:CPU runs this batched product twice as fast as q @ k.T.
        s = jax.lax.dot_general(k, q, (((3,), (3,)), batch))  # [units, num_kv_heads, chunk, rows]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = k_pos[None, :, None] <= q_pos[:, None, :]  # [units, chunk, rows]
        if sliding_window is not None:
            mask &= k_pos[None, :, None] > q_pos[:, None, :] - sliding_window
        s = jnp.where(mask[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=2))  # [units, num_kv_heads, rows]
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[:, :, None, :])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l_sum = alpha * l_sum + jnp.sum(p, axis=2)
        pv = jax.lax.dot_general(p, v, (((2,), (2,)), batch))  # [units, num_kv_heads, rows, head_dim]
        return m_new, l_sum, alpha[..., None] * acc + pv

    shape = (units, num_kv_heads, rows)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    first_chunk = 0
    if sliding_window is not None:
        # Chunks wholly before every row's window hold nothing any row can see: skip them.
        lowest = jnp.min(jnp.where(q_pos >= 0, q_pos, jnp.iinfo(jnp.int32).max))
        first_chunk = jnp.clip((lowest - sliding_window + 1) // chunk, 0, num_chunks)
    _, l_sum, acc = jax.lax.fori_loop(first_chunk, num_chunks, body, init)
    return acc / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]


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
    k_scale: float | jax.Array | None = None,  # quantized pages (see "Quantized pages")
    v_scale: float | jax.Array | None = None,
) -> jax.Array:  # [num_tokens, num_q_heads, head_dim]
    num_tokens, num_q_heads, head_dim = q.shape
    max_num_seqs = kv_lens.shape[0]
    num_kv_heads = kv_pages.shape[1] // 2
    group = num_q_heads // num_kv_heads
    page_size = kv_pages.shape[2]
    chunk = max(1, KV_CHUNK_TOKENS // page_size) * page_size
    attend = lambda q, pos, pages, n: _attend_chunks(
        q, pos, pages, kv_pages, n, sliding_window=sliding_window, soft_cap=soft_cap
    )  # noqa: E731

    seq_ids = jnp.arange(max_num_seqs, dtype=jnp.int32)
    live = seq_ids < num_seqs[0]
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [max_num_seqs]
    k_scale = 1.0 if k_scale is None else k_scale
    qg = (q.astype(jnp.float32) * (sm_scale * k_scale)).reshape(num_tokens, num_kv_heads, group, head_dim)
    out = jnp.zeros((num_tokens + 1, num_kv_heads, group, head_dim), jnp.float32)  # last row: sink

    # Decode rows: one unit per sequence with a single new token, compacted to the front
    # and visited DECODE_GROUP at a time, so the cost follows the decodes actually present
    # (a mostly-prefill step with a few decodes pays for a few).
    is_decode = q_lens == 1
    group_size = min(DECODE_GROUP, max_num_seqs)
    num_groups_padded = -(-max_num_seqs // group_size)
    dec_ids = jnp.nonzero(is_decode, size=num_groups_padded * group_size, fill_value=max_num_seqs)[0]

    def decode_group(i, out):
        ids = jax.lax.dynamic_slice_in_dim(dec_ids, i * group_size, group_size)
        valid = ids < max_num_seqs
        seq = jnp.where(valid, ids, 0)
        rows = jnp.where(valid, cu_q_lens[seq], num_tokens)
        dec_q = jnp.take(qg, rows, axis=0, mode="fill", fill_value=0)  # [group, kv_heads, q_per_kv, d]
        lens = jnp.where(valid, kv_lens[seq], 0)
        dec_pos = jnp.repeat((lens - 1)[:, None], group, axis=1)
        n_chunks = (jnp.max(lens) + chunk - 1) // chunk
        return out.at[rows].set(attend(dec_q, dec_pos, page_indices[seq], n_chunks))

    num_decode_groups = (jnp.sum(is_decode) + group_size - 1) // group_size
    out = jax.lax.fori_loop(0, num_decode_groups, decode_group, out)

    # Prefill rows: each longer sequence's rows in query blocks of BLOCK_Q, then the rest of its
    # rows (fewer than BLOCK_Q) in blocks of TAIL_BLOCK_Q, so that a short prompt's last block is
    # not mostly padding.
    prefill = jnp.where(q_lens > 1, q_lens, 0)
    full = prefill // BLOCK_Q * BLOCK_Q
    for start, count, block_q in ((0, full, BLOCK_Q), (full, prefill - full, TAIL_BLOCK_Q)):
        out = _prefill_blocks(attend, out, qg, kv_lens, page_indices, cu_q_lens, start, count, block_q, chunk)
    if v_scale is not None:
        out = out * v_scale
    return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _prefill_blocks(
    attend,
    out: jax.Array,  # [num_tokens + 1, num_kv_heads, group, head_dim]: the last row is a sink
    qg: jax.Array,  # [num_tokens, num_kv_heads, group, head_dim], scaled
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    start: jax.Array | int,  # [max_num_seqs]: the first row of each sequence's range (from its first new row)
    count: jax.Array,  # [max_num_seqs]: rows in the range (0: none)
    block_q: int,
    chunk: int,
) -> jax.Array:
    """Attention of a range of each sequence's new rows, in query blocks of block_q rows within one
    sequence, ROWS_PER_STEP rows at a time, in the order of the key chunks the blocks need (their
    last row's position decides), so that the blocks handled together visit about as many chunks
    each: a step of many short prompts is mostly blocks of one chunk."""
    num_tokens, num_kv_heads, group, head_dim = qg.shape
    max_num_seqs = kv_lens.shape[0]
    per_step = ROWS_PER_STEP // block_q
    blocks = (count + block_q - 1) // block_q  # [max_num_seqs]
    cum_blocks = jnp.cumsum(blocks)
    # blocks there can be (a sequence with rows in the range has two rows or more), in whole steps
    bound = max(1, -(-(num_tokens // block_q + min(max_num_seqs, num_tokens // 2)) // per_step)) * per_step
    b_all = jnp.arange(bound, dtype=jnp.int32)
    b_seq = jnp.minimum(jnp.searchsorted(cum_blocks, b_all, side="right"), max_num_seqs - 1)
    range_first = cu_q_lens[:-1] + start
    b_first = range_first[b_seq] + (b_all - (cum_blocks[b_seq] - blocks[b_seq])) * block_q
    b_end = jnp.minimum(b_first + block_q, range_first[b_seq] + count[b_seq])
    b_need = (kv_lens[b_seq] - cu_q_lens[b_seq + 1] + b_end - 1) // chunk + 1
    order = jnp.argsort(jnp.where(b_all < cum_blocks[-1], b_need, jnp.iinfo(jnp.int32).max))

    def step(g, out):
        b = jax.lax.dynamic_slice_in_dim(order, g * per_step, per_step)
        seq = b_seq[b]
        rows = b_first[b][:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]  # [blocks, block_q]
        valid = (rows < b_end[b][:, None]) & (b < cum_blocks[-1])[:, None]
        rows = jnp.where(valid, rows, num_tokens)
        pos = jnp.where(valid, kv_lens[seq][:, None] - cu_q_lens[seq + 1][:, None] + rows, -1)
        blk_q = jnp.take(qg, rows, axis=0, mode="fill", fill_value=0)  # [blocks, block_q, kv_heads, group, d]
        blk_q = blk_q.transpose(0, 2, 1, 3, 4).reshape(per_step, num_kv_heads, block_q * group, head_dim)
        n_chunks = (jnp.max(pos) + chunk) // chunk
        blk_pos = jnp.repeat(pos, group, axis=1)  # row r * group + g sits at pos[r]
        blk_out = attend(blk_q, blk_pos, page_indices[seq], n_chunks)
        blk_out = blk_out.reshape(per_step, num_kv_heads, block_q, group, head_dim).transpose(0, 2, 1, 3, 4)
        return out.at[rows].set(blk_out)

    return jax.lax.fori_loop(0, (cum_blocks[-1] + per_step - 1) // per_step, step, out)
