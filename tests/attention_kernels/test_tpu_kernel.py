"""The TPU kernel, run in interpret mode (TPU semantics: DMAs, semaphores, VMEM scratch
that starts as NaN), against plain numpy attention over each sequence's dense keys and
against the reference.

Interpreting costs a few seconds of compilation per static configuration (heads, head_dim,
page size, dtype, block sizes, options), so every case of one configuration shares one set
of array shapes, and the configurations are chosen pairwise rather than as a full product:
each pair of (GQA ratio, head_dim, page size) values and each block-size regime (one KV
block per item or several; sequences inside one q block or across many) appears at least
once."""

from __future__ import annotations

import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_kernels.attention_cases import F32_TOL, QUANTIZED, AttentionCase, build_case

from pallas_kernels.ragged_paged_attention import reference, tpu

MAX_NUM_SEQS = 8  # the mixes below fill 5 slots: the other 3 are padding
NUM_KV_HEADS = 2


def _lengths(page):
    return [1, page - 1, page, page + 1, 2 * page + 3]


MIXES = {
    # kv_len (context + the new token) of 1, page - 1, page, page + 1 and a few pages.
    "decode": lambda p: [(n - 1, 1) for n in _lengths(p)],
    "prefill": lambda p: [(0, n) for n in _lengths(p)],
    # Chunks on cached context (crossing page boundaries) among decodes.
    "mixed": lambda p: [(p - 3, 5), (2 * p + 2, 1), (0, p + 1), (p + 1, p - 1), (4, 1)],
}


def _shapes(page):
    """(num_tokens, pages_per_seq), fixed per page size so that every mix shares them."""
    longest = max(c + q for mix in MIXES.values() for c, q in mix(page))
    most_rows = max(sum(q for _, q in mix(page)) for mix in MIXES.values())
    return most_rows + 9, -(-longest // page) + 1


def make_case(rng, seqs, group, head_dim, page, dtype, num_kv_heads=NUM_KV_HEADS) -> AttentionCase:
    """seqs: (context_len, q_len) per sequence, in the sizes every mix of this page size shares.
    The tables of all MAX_NUM_SEQS slots hold pages; padding query rows are NaN (they must
    stay apart)."""
    num_tokens, pages_per_seq = _shapes(page)
    return build_case(
        rng,
        seqs,
        num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page,
        max_num_seqs=MAX_NUM_SEQS,
        num_tokens=num_tokens,
        pages_per_seq=pages_per_seq,
        dtype=dtype,
        nan_padding=True,
    )


# float32: kernel and dense attention both sum in (at least) float32, in different orders.
# bfloat16: the same bfloat16 inputs, scores and sums in float32 in both, but the kernel
# feeds p to the second matmul in bfloat16 (2^-9 relative per weight, averaging out) and
# rounds its output to bfloat16 (2^-9 relative); the outputs are below 4 in size, so the
# two differ by at most about one bfloat16 step (0.008 to 0.016): seen up to 0.008 here.
TOLERANCE = {jnp.float32: F32_TOL, jnp.bfloat16: dict(atol=1.5e-2, rtol=1e-2)}


@functools.cache
def _kernel(head_dim, **static):
    """One jitted kernel per static configuration; a window, when given, is traced."""

    def run(q, kv, kv_lens, pages, cu, num_seqs, window=None):
        args = (q, kv, kv_lens, pages, cu, num_seqs)
        scale = head_dim**-0.5
        return tpu.ragged_paged_attention(
            *args, sm_scale=scale, sliding_window=window, interpret=True, **static
        )

    return jax.jit(run)


@functools.cache
def _reference(head_dim, cap):
    def run(q, kv, kv_lens, pages, cu, num_seqs, window=None):
        return reference.ragged_paged_attention(
            q, kv, kv_lens, pages, cu, num_seqs, sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=cap
        )

    return jax.jit(run)


def _check(case: AttentionCase, dtype, window=None, cap=None, **blocks):
    head_dim = case.q.shape[-1]
    out = _kernel(head_dim, soft_cap=cap, **blocks)(*case.args, *([] if window is None else [window]))
    assert out.dtype == dtype and out.shape == case.q.shape
    out = np.asarray(out, np.float64)
    assert np.all(out[int(case.cu_q_lens[-1]) :] == 0.0)  # padding rows (NaN queries) are zeros
    np.testing.assert_allclose(out, case.expected(window, cap), **TOLERANCE[dtype])
    return out


# (group, head_dim, page size, block_q, pages_per_block): every pair of group, head_dim and
# page size once; None = the default blocks (one q block holds several sequences, one KV
# block covers a whole sequence), small blocks = prefills over several q blocks and several
# KV blocks per item, with the prefetch of the next item's first block.
CONFIGS = [
    (1, 64, 16, None, None),
    (1, 128, 32, 8, 1),
    (2, 64, 32, 16, 2),
    (2, 128, 16, None, None),
    (4, 64, 16, 16, 1),
    (4, 128, 32, None, None),
    (8, 64, 32, None, 1),
    (8, 128, 16, 16, 2),
]


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "g{}-d{}-p{}-bq{}-ppb{}".format(*c))
def test_kernel_matches_dense_attention(config, mix):
    group, head_dim, page, block_q, pages_per_block = config
    rng = np.random.default_rng(zlib.crc32(repr((config, mix)).encode()))
    seqs = MIXES[mix](page)
    case = make_case(rng, seqs, group, head_dim, page, jnp.float32)
    _check(case, jnp.float32, block_q=block_q, pages_per_block=pages_per_block)


# Windows from one key to more than the longest context (a window that wide is full
# attention); sliding_window is traced here, as a layer scan passes it.
@pytest.mark.parametrize("window", [1, 5, 17, 40, 2**31 - 1])
def test_traced_sliding_window(window):
    rng = np.random.default_rng(window % 1000)
    seqs = MIXES["mixed"](16) + [(45, 1)]
    case = make_case(rng, seqs, 2, 64, 16, jnp.float32)
    _check(case, jnp.float32, window=jnp.int32(window), block_q=16, pages_per_block=1)


@pytest.mark.parametrize(
    "window, cap, page",
    [(7, None, 16), (None, 5.0, 32), (20, 2.0, 16)],
    ids=["window", "soft-cap", "window-and-soft-cap"],
)
def test_static_window_and_soft_cap(window, cap, page):
    rng = np.random.default_rng(7)
    seqs = MIXES["mixed"](page)
    case = make_case(rng, seqs, 4, 64, page, jnp.float32)
    head_dim = case.q.shape[-1]
    run = jax.jit(
        lambda *a: tpu.ragged_paged_attention(
            *a,
            sm_scale=head_dim**-0.5,
            sliding_window=window,
            soft_cap=cap,
            pages_per_block=1,
            interpret=True,
        )
    )
    out = np.asarray(run(*case.args))
    np.testing.assert_allclose(out, case.expected(window, cap), **TOLERANCE[jnp.float32])


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize(
    "config, window, cap",
    [((4, 128, 16, None, 2), None, None), ((1, 64, 32, 16, 1), 9, 30.0)],
    ids=["g4-d128-p16", "g1-d64-p32-window-soft-cap"],
)
def test_bfloat16(config, window, cap, mix):
    group, head_dim, page, block_q, pages_per_block = config
    rng = np.random.default_rng(11)
    seqs = MIXES[mix](page)
    case = make_case(rng, seqs, group, head_dim, page, jnp.bfloat16)
    window = None if window is None else jnp.int32(window)
    out = _check(case, jnp.bfloat16, window, cap, block_q=block_q, pages_per_block=pages_per_block)
    # The reference on the same bfloat16 inputs (float32 inside, bfloat16 out).
    want = _reference(head_dim, cap)(*case.args, window)
    np.testing.assert_allclose(out, np.asarray(want, np.float64), **TOLERANCE[jnp.bfloat16])


def test_matches_reference_with_stale_slots():
    """Slots past num_seqs hold stale lengths and offsets (only num_seqs says where the batch
    ends); the kernel agrees with the reference on every row, padding rows included."""
    rng = np.random.default_rng(5)
    seqs = MIXES["mixed"](16)
    q, kv, kv_lens, pages, cu, num_seqs = make_case(rng, seqs, 2, 64, 16, jnp.float32).args
    q = jnp.where(jnp.isnan(q), 1.0, q)  # the reference multiplies padding rows too
    kv_lens = kv_lens.at[len(seqs) :].set(7)
    cu = cu.at[len(seqs) + 1 :].set(cu[len(seqs)] + 3 * jnp.arange(1, MAX_NUM_SEQS - len(seqs) + 1))
    case = (q, kv, kv_lens, pages, cu, num_seqs)
    out = np.asarray(_kernel(64, soft_cap=None, block_q=16, pages_per_block=1)(*case))
    want = np.asarray(_reference(64, None)(*case))
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)
    assert np.all(out[int(cu[len(seqs)]) :] == 0.0)


def test_empty_batch_is_all_zeros():
    rng = np.random.default_rng(6)
    q, kv, kv_lens, pages, cu, _ = make_case(rng, [], 2, 64, 16, jnp.float32).args
    out = _kernel(64, soft_cap=None, block_q=16, pages_per_block=1)(
        jnp.zeros_like(q), kv, kv_lens, pages, cu, jnp.zeros((1,), jnp.int32)
    )
    assert np.all(np.asarray(out) == 0.0)


def test_rejects_uneven_heads_and_ragged_tiles():
    q = jnp.zeros((8, 3, 64))
    kv = jnp.zeros((4, 4, 16, 64))
    args = (
        jnp.ones(2, jnp.int32),
        jnp.zeros((2, 2), jnp.int32),
        jnp.zeros(3, jnp.int32),
        jnp.ones(1, jnp.int32),
    )
    with pytest.raises(ValueError, match="split evenly"):
        tpu.ragged_paged_attention(q, kv, *args, sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="multiple of 8"):
        tpu.ragged_paged_attention(jnp.zeros((8, 2, 64)), kv, *args, sm_scale=1.0, block_q=4, interpret=True)


def test_window_per_layer_in_a_scan():
    """A model scanning over layers passes each layer's window as a scanned value."""
    rng = np.random.default_rng(8)
    seqs = MIXES["mixed"](16)
    case = make_case(rng, seqs, 2, 64, 16, jnp.float32)
    windows = jnp.asarray([3, 2**31 - 1, 20], jnp.int32)

    def layer(carry, window):
        out = tpu.ragged_paged_attention(
            *case.args,
            sm_scale=64**-0.5,
            sliding_window=window,
            block_q=16,
            pages_per_block=1,
            interpret=True,
        )
        return carry, out

    _, outs = jax.jit(lambda w: jax.lax.scan(layer, 0, w))(windows)
    for window, out in zip(np.asarray(windows), np.asarray(outs)):
        np.testing.assert_allclose(out, case.expected(int(window)), **TOLERANCE[jnp.float32])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mix", ["decode", "mixed"])
def test_group_not_a_power_of_two(mix, dtype):
    """Three q heads per kv head: a decode's rows [3t, 3t + 3) sometimes fit one aligned
    sub-tile and sometimes straddle two, so one batch takes both the sub-tile and the
    whole-block path."""
    rng = np.random.default_rng(12)
    seqs = MIXES[mix](16)
    case = make_case(rng, seqs, 3, 64, 16, dtype)
    _check(case, dtype, block_q=16, pages_per_block=1)


@pytest.mark.parametrize(
    "group, dtype, block_rows, rows",
    [
        (4, jnp.bfloat16, 128, 16),  # Llama-3-8B decode in bfloat16: 16 of 128 rows
        (4, jnp.float32, 128, 8),
        (1, jnp.float32, 128, 8),
        (16, jnp.float32, 128, 16),  # one token's rows fill a whole sub-tile
        (3, jnp.float32, 48, 8),
        (1, jnp.bfloat16, 8, 8),  # a q block smaller than bfloat16's 16-row tile: no sub-tile
        (8, jnp.bfloat16, 24, 24),
    ],
)
def test_sub_tile_rows(group, dtype, block_rows, rows):
    assert tpu._sub_rows(group, dtype, block_rows) == rows


@pytest.mark.parametrize("dtype, k_scale, v_scale", QUANTIZED)
@pytest.mark.parametrize("mix", ["decode", "mixed"])
def test_quantized_pages(dtype, k_scale, v_scale, mix):
    """int8 and fp8 pages with their scales (pages of 32 tokens: a 1-byte dtype packs 32 rows
    in a sublane tile), several KV blocks per item so the copies are double-buffered."""
    rng = np.random.default_rng(13)
    case = make_case(rng, MIXES[mix](32), 2, 64, 32, jnp.float32).quantized(dtype, k_scale, v_scale)
    run = jax.jit(
        lambda *a: tpu.ragged_paged_attention(
            *a[:6],
            sm_scale=64**-0.5,
            k_scale=a[6],
            v_scale=a[7],
            block_q=16,
            pages_per_block=1,
            interpret=True,
        )
    )
    out = np.asarray(run(*case.args, case.k_scale, case.v_scale), np.float64)
    assert np.all(out[int(case.cu_q_lens[-1]) :] == 0.0)
    np.testing.assert_allclose(out, case.expected(), **TOLERANCE[jnp.float32])


def test_refuses_int8_pages_of_16_tokens():
    case = make_case(np.random.default_rng(0), MIXES["decode"](16), 2, 64, 16, jnp.float32)
    case = case.quantized("int8", 0.03, 0.05)
    with pytest.raises(ValueError, match="multiple of 32 for int8 pages"):
        tpu.ragged_paged_attention(*case.args, sm_scale=0.1, interpret=True, **case.scales)


def target_tpu(monkeypatch, generation: str = "v5e") -> None:
    """Let Pallas lower for a TPU of `generation` on this CPU (lowering asks the device
    for its chip's facts)."""
    from jax._src.pallas.mosaic import tpu_info

    chip = tpu_info.ChipVersion(generation)
    monkeypatch.setitem(tpu_info.registry, "cpu", lambda: tpu_info.get_tpu_info_for_chip(chip, 1))


@pytest.mark.parametrize("generation", ["v5e", "v6e", "v5p"])
@pytest.mark.parametrize(
    "group, head_dim, page, dtype, window, cap, pages",
    [
        (4, 128, 16, jnp.bfloat16, None, None, None),
        (1, 64, 32, jnp.float32, 100, 30.0, None),
        (8, 128, 32, jnp.bfloat16, 64, None, None),
        (4, 128, 32, jnp.bfloat16, None, None, "int8"),
    ],
)
def test_lowers_to_mosaic(monkeypatch, generation, group, head_dim, page, dtype, window, cap, pages):
    """The kernel lowers through Mosaic for a TPU target (every primitive has a Mosaic
    lowering, block shapes are legal for the generation) and the Mosaic module verifies.
    This is no compile for a TPU (libtpu does that): layouts are not checked here."""
    from jax._src.pallas.mosaic import lowering

    target_tpu(monkeypatch, generation)
    modules = []
    lower = lowering.lower_jaxpr_to_pipelined_module

    def lower_and_keep(*args, **kwargs):
        modules.append(lower(*args, **kwargs))
        return modules[-1]

    monkeypatch.setattr(lowering, "lower_jaxpr_to_pipelined_module", lower_and_keep)
    case = make_case(np.random.default_rng(0), MIXES["mixed"](page), group, head_dim, page, dtype)
    if pages is not None:
        case = case.quantized(pages, 0.03, 0.05)
    window = None if window is None else jnp.int32(window)
    fn = (
        lambda *a: tpu.ragged_paged_attention(  # noqa: E731
            *a[:-1], sm_scale=head_dim**-0.5, sliding_window=a[-1], soft_cap=cap, **case.scales
        )
    )
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*case.args, window)
    assert exported.mlir_module().count("tpu_custom_call") == 1
    assert len(modules) == 1 and modules[0].operation.verify()
    text = str(modules[0])
    # Two attention paths: the matmuls run on the sub-tile's rows and on the whole block's.
    block_rows = tpu.default_blocks(group, page)[0] * group
    lhs_rows = {int(m) for m in re.findall(r"tpu\.matmul .*: vector<(\d+)x", text)}
    assert lhs_rows == {tpu._sub_rows(group, dtype, block_rows), block_rows}
    assert "tpu.enqueue_dma" in text and "tpu.wait_dma" in text
