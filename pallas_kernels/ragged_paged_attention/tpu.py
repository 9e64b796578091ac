"""Ragged paged attention for TPUs: one Pallas kernel lowered through Mosaic.

Same contract as reference.py (signature, KV layout, ragged batch, padding rows zero,
sliding window as a Python int, None or a traced int32 scalar, soft cap); the extra
keyword arguments only tune block sizes. `interpret=True` runs the kernel with TPU
semantics (DMAs, semaphores, VMEM scratch) on any backend.

## Layout seen by the kernel

The q heads that share a kv head are laid out as the rows of one 2-D tile: the wrapper
turns q [num_tokens, num_q_heads, head_dim] into [num_kv_heads, tokens * group, head_dim]
(row r of kv head h: token r // group, q head h * group + r % group), with the tokens
padded to whole q blocks. So one read of a key/value tile serves every q head of its kv
head, and both matmuls are plain 2-D products.

## Grid, blocks and work items

Grid (num_kv_heads, max_items). The tokens are cut into q blocks of `block_q` tokens
(block_rows = block_q * group rows), aligned to the flat batch, so a block may hold the
tail of one sequence, a few whole short ones (decodes) and the head of the next. A work
item is one (q block, sequence) pair with rows in common; the wrapper lists them in
block order, every block at least once (blocks of padding only get one item that just
writes zeros). There are at most num_q_blocks + max_num_seqs of them: items past the
batch's count repeat the last block index and do nothing. The q and output blocks
([block_rows, head_dim]) are ordinary pipelined BlockSpecs indexed by the item's q block,
so consecutive items of one block reuse the resident output tile: the first item of a
block zeroes it and each item then writes only its own sequence's rows.

Per item, the kernel walks KV blocks of `pages_per_block` pages (block_k = pages_per_block
* page_size keys) from the first block any of its rows can see (the sliding window) to
the last one (causality, the item's last token); blocks outside that range are never
read. Pages of a block past the sequence's length are not copied.

An item whose rows fit inside one aligned sub-tile of `_sub_rows` rows (the dtype's packed
sublane tile, or the group if larger) computes on that sub-tile only: a decode is `group`
rows, so with Llama-3-8B's heads in bfloat16 it works on 16 rows of a 128-row block, and
its softmax and masks cost an eighth of the whole block's. The choice is made per item at
run time; items that straddle sub-tiles (prefill chunks, or a decode whose group does not
divide the sub-tile) use the whole block.

## Buffering

kv_pages stays in HBM (memory_space ANY). For kv head h, page p of a block is one DMA of
kv_pages[page, 2h:2h+2] (its key and value tiles, contiguous) into a VMEM scratch
[2 (slot), pages_per_block, 2 (k|v), page_size, head_dim], one DMA semaphore per slot.
While block i is computed from one slot, block i + 1 is copied into the other; the last
block of an item prefetches the first block of the next item (state carried across grid
steps in a small SMEM scratch: the next slot, and whether its copy is in flight). A new
kv head (work item 0) starts from scratch, so the kv-head axis can be split across cores.

## Online softmax

Running max m and sum l ([block_rows, 128], replicated over the lanes) and the accumulator
acc ([block_rows, head_dim]) live in float32 VMEM scratch. Scores are q @ k.T in float32
(inputs in their own dtype), scaled, soft-capped, masked (causal, window) with a large
finite negative value, and p is cast to q's dtype for p @ v. Quantized pages (int8, fp8) are
cast to q's dtype after their copy into VMEM, so they cost a quarter (of float32) or half (of
bfloat16) the HBM reads; their scales are folded into q and the output (reference.py,
"Quantized pages").

## TPU constraints

- page_size a multiple of the sublane packing of the KV dtype (8 for float32, 16 for
  bfloat16), so that the pages of a block stack into one [block_k, head_dim] tile without
  relayout; block_k a multiple of 128 keeps the scores lane-dense (the default does for
  page sizes up to 256 when pages_per_seq allows).
- block_q * group rows a multiple of 8 (16 for bfloat16, as the default block_q is).
- head_dim: any; 128 (or a multiple) fills the lanes. The engine pads a smaller head_dim
  to 128 in its KV pool (a TPU would pad it in HBM anyway), see layers/attention.py.
- The scalar prefetch sits in SMEM: the flattened page table (max_num_seqs * pages_per_seq
  int32) plus the work list must fit next to the kernel's own scalars.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.reference import fold_scales

LANES = 128
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # masked scores: exp() of it is 0, no inf - inf
DEFAULT_MXU_WIDTH = 128  # where no TPU answers (interpret mode on another platform)


def sublane_rows(dtype) -> int:
    """Rows of one packed sublane tile of `dtype` (8 rows of 32 bits: 16 for bfloat16): a
    TPU stores the last two dimensions of an array in tiles of (sublane_rows, 128 lanes)."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def default_blocks(group: int, page_size: int) -> tuple[int, int]:
    """(block_q, pages_per_block) for this TPU generation: q tiles of about as many rows
    (tokens * group) as its MXU is wide (128 on v4 and v5, 256 on v6e and later), so one
    tile fills the systolic array, and KV blocks of about twice that many keys, so each
    step's page copies are large enough to hide behind the previous block's compute."""
    try:
        mxu = pltpu.get_tpu_info().mxu_column_size
    except ValueError:  # not a TPU
        mxu = DEFAULT_MXU_WIDTH
    # block_q: a multiple of 16 tokens, so the tile rows are a multiple of bfloat16's 16-row packing.
    return max(16, mxu // group // 16 * 16), max(1, 2 * mxu // page_size)


def _kernel(
    # Scalar prefetch (SMEM).
    item_seq_ref,  # [max_items] int32: the item's sequence
    item_blk_ref,  # [max_items] int32: the item's q block
    num_items_ref,  # [1] int32: items in this batch
    kv_lens_ref,  # [max_num_seqs] int32
    pages_ref,  # [max_num_seqs * pages_per_seq] int32, the page table flattened
    cu_ref,  # [max_num_seqs + 1] int32, empty past num_seqs
    window_ref,  # [1] int32 (unused without a window)
    # Inputs.
    q_ref,  # [block_rows, head_dim] (kv head squeezed)
    kv_hbm_ref,  # [num_pages, 2 * num_kv_heads, page_size, head_dim], in HBM
    # Output.
    o_ref,  # [block_rows, head_dim]
    # Scratch.
    kv_buf,  # [2, pages_per_block, 2, page_size, head_dim] VMEM, kv_pages.dtype
    sems,  # [2] DMA semaphores, one per slot
    state_ref,  # [2] int32 SMEM: slot of the next block; 1 if its copy is already started
    m_ref,  # [block_rows, 128] float32
    l_ref,  # [block_rows, 128] float32
    acc_ref,  # [block_rows, head_dim] float32
    *,
    sm_scale: float,
    soft_cap: float | None,
    has_window: bool,
    block_q: int,
    group: int,
    pages_per_block: int,
    page_size: int,
    pages_per_seq: int,
    sub_rows: int,
):
    h, w = pl.program_id(0), pl.program_id(1)
    max_items = pl.num_programs(1)
    num_items = num_items_ref[0]
    block_rows = block_q * group
    block_k = pages_per_block * page_size

    def item(i):
        """Scalars of work item i: sequence, q block, its rows and the KV blocks they see."""
        seq, blk = item_seq_ref[i], item_blk_ref[i]
        q_start, q_end, kv_len = cu_ref[seq], cu_ref[seq + 1], kv_lens_ref[seq]
        blk_start = blk * block_q
        t_lo = jnp.maximum(q_start, blk_start)  # the item's tokens: [t_lo, t_hi)
        t_hi = jnp.minimum(q_end, blk_start + block_q)
        base = kv_len - q_end + blk_start  # position of the block's first token in this sequence
        last_pos = base + (t_hi - 1 - blk_start)
        window = jnp.minimum(window_ref[0], kv_len) if has_window else kv_len
        first_key = jnp.maximum(base + (t_lo - blk_start) - window + 1, 0)
        kb_first = first_key // block_k
        kb_end = jnp.where(t_lo < t_hi, last_pos // block_k + 1, kb_first)
        names = ("seq", "blk", "t_lo", "t_hi", "base", "kv_len", "window", "kb_first", "kb_end")
        return dict(zip(names, (seq, blk, t_lo, t_hi, base, kv_len, window, kb_first, kb_end)))

    def copy_block(it, kb, slot, action):
        """Start (or wait for) the DMAs of KV block kb of item `it` into `slot`."""
        num_pages = pl.cdiv(it["kv_len"], page_size)

        def copy_page(p):  # page p of the block, page j of the sequence
            j = kb * pages_per_block + p

            @pl.when(j < num_pages)
            def _():
                page = pages_ref[it["seq"] * pages_per_seq + j]
                copy = pltpu.make_async_copy(
                    kv_hbm_ref.at[page, pl.ds(2 * h, 2)],  # [2 (k|v), page_size, head_dim]
                    kv_buf.at[slot, p],
                    sems.at[slot],
                )
                if action == "start":
                    copy.start()
                else:
                    copy.wait()

        for p in range(pages_per_block):
            copy_page(p)

    @pl.when(w == 0)
    def _():  # a new kv head: no copy in flight; stale pages must be finite (p = 0 times them)
        kv_buf[...] = jnp.zeros_like(kv_buf)
        state_ref[0] = 0
        state_ref[1] = 0

    @pl.when(w < num_items)
    def _():
        cur = item(w)
        first_of_block = (w == 0) | (item_blk_ref[jnp.maximum(w - 1, 0)] != cur["blk"])

        @pl.when(first_of_block)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        @pl.when(cur["kb_end"] > cur["kb_first"])
        def _():
            @pl.when(state_ref[1] == 0)
            def _():
                copy_block(cur, cur["kb_first"], state_ref[0], "start")

            nxt = item(jnp.minimum(w + 1, max_items - 1))
            prefetch_next = (w + 1 < num_items) & (nxt["kb_end"] > nxt["kb_first"])
            blk_start = cur["blk"] * block_q
            r_lo = (cur["t_lo"] - blk_start) * group  # the item's rows of the tile: [r_lo, r_hi)
            r_hi = (cur["t_hi"] - blk_start) * group

            def attend(rows: int, row0):
                """The item over tile rows [row0, row0 + rows) (row0 a multiple of rows)."""
                tile = pl.ds(pl.multiple_of(row0, rows), rows)
                m_ref[tile, :] = jnp.full((rows, LANES), -jnp.inf, jnp.float32)
                l_ref[tile, :] = jnp.zeros((rows, LANES), jnp.float32)
                acc_ref[tile, :] = jnp.zeros((rows, acc_ref.shape[1]), jnp.float32)
                q = q_ref[tile, :]  # [rows, head_dim]
                precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

                def body(kb, slot):
                    copy_block(cur, kb, slot, "wait")

                    @pl.when(kb + 1 < cur["kb_end"])
                    def _():
                        copy_block(cur, kb + 1, 1 - slot, "start")

                    @pl.when((kb + 1 == cur["kb_end"]) & prefetch_next)
                    def _():
                        copy_block(nxt, nxt["kb_first"], 1 - slot, "start")

                    # [pages_per_block, page_size, head_dim] -> [block_k, head_dim]
                    # Quantized pages are cast to q's dtype here; their scales are folded
                    # into q and the output outside the kernel (reference.fold_scales).
                    k = kv_buf[slot, :, 0].reshape(block_k, q.shape[1]).astype(q.dtype)
                    v = kv_buf[slot, :, 1].reshape(block_k, q.shape[1]).astype(q.dtype)
                    nt = (((1,), (1,)), ((), ()))  # q @ k.T
                    s = jax.lax.dot_general(q, k, nt, preferred_element_type=jnp.float32, precision=precision)
                    s = s * sm_scale  # [rows, block_k] float32
                    if soft_cap is not None:
                        s = soft_cap * jnp.tanh(s / soft_cap)
                    # Tile row r holds token blk_start + r // group at position base + r // group;
                    # with d = (key_pos - base) * group, the key is visible iff d <= r (causal)
                    # and r - d < window * group (window), no division needed.
                    row = row0 + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
                    col = jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
                    d = (kb * block_k + col - cur["base"]) * group
                    visible = d <= row
                    if has_window:
                        visible &= row - d < cur["window"] * group
                    s = jnp.where(visible, s, MASK_VALUE)

                    m_prev = m_ref[tile, :]  # [rows, 128]
                    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                    alpha = jnp.exp(m_prev - m_new)
                    p = jnp.exp(s - m_new[:, :1])  # [rows, block_k]
                    l_ref[tile, :] = alpha * l_ref[tile, :] + jnp.sum(p, axis=1, keepdims=True)
                    pv = jax.lax.dot(
                        p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision
                    )  # [rows, head_dim]
                    acc_ref[tile, :] = alpha[:, :1] * acc_ref[tile, :] + pv
                    m_ref[tile, :] = m_new
                    return 1 - slot

                state_ref[0] = jax.lax.fori_loop(cur["kb_first"], cur["kb_end"], body, state_ref[0])
                # Only this sequence's rows of the tile.
                r = row0 + jax.lax.broadcasted_iota(jnp.int32, (rows, acc_ref.shape[1]), 0)
                out = acc_ref[tile, :] / l_ref[tile, :][:, :1]
                o_ref[tile, :] = jnp.where((r >= r_lo) & (r < r_hi), out.astype(o_ref.dtype), o_ref[tile, :])

            if sub_rows < block_rows:
                # An item whose rows fit in one aligned sub-tile (a decode: `group` rows; a short
                # chunk) computes on that sub-tile only, not on the whole q block.
                sub0 = r_lo // sub_rows * sub_rows
                fits = r_hi <= sub0 + sub_rows

                @pl.when(fits)
                def _():
                    attend(sub_rows, sub0)

                @pl.when(jnp.logical_not(fits))
                def _():
                    attend(block_rows, 0)

            else:
                attend(block_rows, 0)
            state_ref[1] = prefetch_next.astype(jnp.int32)


def _sub_rows(group: int, dtype, block_rows: int) -> int:
    """Rows of the sub-tile a short item computes on: a whole number of the dtype's packed
    sublane tiles (8 rows of 32 bits) holding at least one token's `group` rows, or the
    whole q block if that does not divide it."""
    rows = max(sublane_rows(dtype), 1 << (group - 1).bit_length())
    return rows if block_rows % rows == 0 else block_rows


def _work_items(cu_q_lens, num_seqs, num_q_blocks: int, block_q: int):
    """The (sequence, q block) pairs with rows in common, in block order, every block at
    least once. Returns (item_seq, item_blk, num_items, cu) with cu emptied past num_seqs."""
    max_num_seqs = cu_q_lens.shape[0] - 1
    idx = jnp.arange(max_num_seqs + 1, dtype=jnp.int32)
    n = num_seqs[0]
    cu = jnp.where(idx <= n, cu_q_lens, cu_q_lens[n]).astype(jnp.int32)
    total = cu[-1]
    starts = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    last_rows = jnp.minimum(starts + block_q, total) - 1
    first = jnp.searchsorted(cu[1:], starts, side="right").astype(jnp.int32)  # sequence of row `start`
    last = jnp.searchsorted(cu[1:], last_rows, side="right").astype(jnp.int32)
    count = jnp.where(starts < total, last - first + 1, 1)  # padding-only blocks: one item
    first = jnp.minimum(first, max_num_seqs - 1)
    ends = jnp.cumsum(count)
    max_items = num_q_blocks + max_num_seqs
    w = jnp.arange(max_items, dtype=jnp.int32)
    blk = jnp.minimum(jnp.searchsorted(ends, w, side="right"), num_q_blocks - 1).astype(jnp.int32)
    seq = jnp.minimum(first[blk] + w - (ends[blk] - count[blk]), max_num_seqs - 1).astype(jnp.int32)
    return seq, blk, ends[-1:].astype(jnp.int32), cu


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
    block_q: int | None = None,  # tokens per q block; default: see default_blocks
    pages_per_block: int | None = None,  # pages per KV block; default: see default_blocks
    interpret: bool | pltpu.InterpretParams = False,
    k_scale: float | jax.Array | None = None,  # quantized pages (reference.py, "Quantized pages")
    v_scale: float | jax.Array | None = None,
) -> jax.Array:  # [num_tokens, num_q_heads, head_dim]
    q, out_scale = fold_scales(q, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    _, combined, page_size, _ = kv_pages.shape
    num_kv_heads = combined // 2
    group = num_q_heads // num_kv_heads
    max_num_seqs, pages_per_seq = page_indices.shape
    if num_q_heads != group * num_kv_heads or combined != 2 * num_kv_heads:
        raise ValueError(f"{num_q_heads} q heads do not split evenly over {combined} // 2 kv heads")
    if page_size % sublane_rows(kv_pages.dtype):
        raise ValueError(
            f"page size {page_size} must be a multiple of {sublane_rows(kv_pages.dtype)} for "
            f"{jnp.dtype(kv_pages.dtype).name} pages (the TPU's packed sublane tile)"
        )
    default_q, default_pages = default_blocks(group, page_size)
    block_q = block_q or default_q
    if block_q * group % 8:
        raise ValueError(f"block_q * group = {block_q} * {group} rows must be a multiple of 8")
    pages_per_block = min(pages_per_block or default_pages, pages_per_seq)
    block_rows = block_q * group
    num_q_blocks = -(-num_tokens // block_q)
    padded_tokens = num_q_blocks * block_q

    item_seq, item_blk, num_items, cu = _work_items(cu_q_lens, num_seqs, num_q_blocks, block_q)
    window = jnp.zeros((1,), jnp.int32)
    if sliding_window is not None:
        window = jnp.asarray(sliding_window, jnp.int32).reshape(1)

    # [num_tokens, num_q_heads, head_dim] -> [num_kv_heads, padded_tokens * group, head_dim]
    qt = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    qt = qt.reshape(padded_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    qt = qt.reshape(num_kv_heads, padded_tokens * group, head_dim)

    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        has_window=sliding_window is not None,
        block_q=block_q,
        group=group,
        pages_per_block=pages_per_block,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        sub_rows=_sub_rows(group, q.dtype, block_rows),
    )
    q_block = pl.BlockSpec((None, block_rows, head_dim), lambda h, w, seq, blk, *_: (h, blk[w], 0))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(num_kv_heads, num_q_blocks + max_num_seqs),
            in_specs=[q_block, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_block,
            scratch_shapes=[
                pltpu.VMEM((2, pages_per_block, 2, page_size, head_dim), kv_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((2,), jnp.int32),
                pltpu.VMEM((block_rows, LANES), jnp.float32),
                pltpu.VMEM((block_rows, LANES), jnp.float32),
                pltpu.VMEM((block_rows, head_dim), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        name="ragged_paged_attention",
    )(
        item_seq,
        item_blk,
        num_items,
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32).reshape(-1),
        cu,
        window,
        qt,
        kv_pages,
    )
    out = out.reshape(num_kv_heads, padded_tokens, group, head_dim).transpose(1, 0, 2, 3)
    out = out.reshape(padded_tokens, num_q_heads, head_dim)[:num_tokens]
    return out if v_scale is None else (out.astype(jnp.float32) * out_scale).astype(q.dtype)
