"""A pipeline's microbatches (layers/pipeline.py): a step's tokens cut into consecutive ranges,
each range written into the pool and attended in turn with the step's metadata cut to it
(`microbatch_metadata`), give the whole step's output and pool, on every attention backend
(the CPU's reference and native kernel, the TPU and GPU kernels interpreted). The cuts fall
inside sequences, between them and in the padding, so a microbatch holds sequences with no query
rows and sequences whose later rows are not written yet."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_kernels.attention_cases import F32_TOL, build_case

from jaxserve.layers.attention import AttentionMetadata, paged_attention
from jaxserve.layers.pipeline import microbatch_metadata, num_microbatches

SEQS = [(0, 7), (20, 1), (33, 5), (3, 9), (0, 2)]  # (context, new tokens): 24 rows, 8 padding
TOKENS, PAGE, KV_HEADS, HEAD_DIM = 32, 16, 2, 128


def _step(backend):
    rng = np.random.default_rng(0)
    case = build_case(
        rng, SEQS, num_q_heads=4, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE,
        max_num_seqs=8, num_tokens=TOKENS,
    )  # fmt: skip
    pages = np.asarray(case.page_indices)
    slots = [pages[i, p // PAGE] * PAGE + p % PAGE for i, (c, n) in enumerate(SEQS) for p in range(c, c + n)]
    slots += [case.kv.shape[0] * PAGE] * (TOKENS - len(slots))  # padding rows: past the pool
    k, v = (jnp.asarray(rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in "kv")
    meta = AttentionMetadata(
        jnp.asarray(slots, jnp.int32), case.kv_lens, case.page_indices, case.cu_q_lens, case.num_seqs, backend
    )
    return case, k, v, meta


@jax.jit
def _attend(q, k, v, pool, meta):
    return paged_attention(q, k, v, pool, jnp.int32(0), pool.shape[0], meta, sm_scale=HEAD_DIM**-0.5)


@jax.jit
def _attend_range(q, k, v, pool, meta, start, size_of):
    size = size_of.shape[0]
    cut = microbatch_metadata(meta, start, size)
    q, k, v = (jax.lax.dynamic_slice_in_dim(a, start, size) for a in (q, k, v))
    return _attend(q, k, v, pool, cut)


@pytest.mark.parametrize("backend", ["reference", "tpu-interpret", "gpu-interpret"])
def test_microbatches_in_turn_give_the_whole_step(backend):
    case, k, v, meta = _step(backend)
    want_out, want_pool = _attend(case.q, k, v, case.kv, meta)
    rows = case.num_rows
    for micro in (2, 4, 8):
        size = TOKENS // micro
        pool, outs = case.kv, []
        for m in range(micro):
            out, pool = _attend_range(case.q, k, v, pool, meta, jnp.int32(m * size), jnp.zeros(size))
            outs.append(np.asarray(out))
        got = np.concatenate(outs)
        np.testing.assert_allclose(got[:rows], np.asarray(want_out)[:rows], **F32_TOL, err_msg=f"{micro}")
        assert np.array_equal(np.asarray(pool), np.asarray(want_pool)), micro


def test_a_microbatch_without_the_later_rows_misses_them():
    """The cut's KV lengths matter: attending a range with the whole step's lengths reads keys
    of rows not written yet (the pool's old contents) and gives another answer."""
    case, k, v, meta = _step("reference")
    want_out, _ = _attend(case.q, k, v, case.kv, meta)
    first = slice(0, 4)  # sequence 0's first four rows; its rows 4..6 come later
    cut_rows = jax.tree.map(lambda a: a, microbatch_metadata(meta, jnp.int32(0), 4))
    uncut = AttentionMetadata(
        meta.slot_mapping[first],
        meta.kv_lens,
        meta.page_indices,
        cut_rows.cu_q_lens,
        meta.num_seqs,
        "reference",
    )
    right, _ = _attend(case.q[first], k[first], v[first], case.kv, cut_rows)
    wrong, _ = _attend(case.q[first], k[first], v[first], case.kv, uncut)
    np.testing.assert_allclose(np.asarray(right), np.asarray(want_out)[first], **F32_TOL)
    assert not np.allclose(np.asarray(wrong), np.asarray(want_out)[first], atol=1e-3)


@pytest.mark.parametrize(
    "tokens,ridge,stages,want",
    [
        (8, 256, 2, 1),  # a decode step: each microbatch would read the weights again
        (512, 256, 2, 2),  # 2 x 256 in 3 ticks of 256 rows, against 2 ticks of 512
        (2048, 256, 2, 8),  # 9 ticks of 256 < 5 of 512 < 3 of 1024 < 2 of 2048
        (2048, 560, 2, 4),  # a v6e: 5 ticks of 560 (512 rows, read-bound) < 3 of 1024 < 9 of 560
        (768, 256, 4, 4),  # 4 stages: 7 ticks of 256 (192 rows, read-bound) < 5 of 384 < 4 of 768
        (96, 16, 2, 4),
        (64, 0, 2, 1),  # never cut
        (1, 1, 2, 1),
    ],
)
def test_microbatches_take_the_fewest_ticks(tokens, ridge, stages, want):
    assert num_microbatches(tokens, ridge, stages) == want
