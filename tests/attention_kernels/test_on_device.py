"""The platform's Pallas kernel against the reference on a real TPU or GPU (compiled, not
interpreted), over decode, prefill and mixed batches of realistic heads, in float32 and
bfloat16. Skipped on CPU; scripts/accelerator_check.sh runs it on a lent machine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_kernels.attention_cases import build_case

from jaxserve.layers.attention import _kernel, resolve_attention_backend
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

pytestmark = pytest.mark.accelerator

PLATFORM = jax.devices()[0].platform


def _case(rng, seqs, num_q_heads, num_kv_heads, head_dim, page_size, dtype, max_num_seqs=16):
    """seqs: (context_len, q_len) per sequence; pages scattered through the pool, padding rows too."""
    return build_case(
        rng,
        seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        num_tokens=sum(q_len for _, q_len in seqs) + 7,
        dtype=dtype,
    )


BATCHES = {
    "decode": [(2047, 1)] * 8 + [(100, 1), (5, 1)],
    "prefill": [(0, 300), (0, 17), (0, 1)],
    "mixed": [(1000, 1), (0, 129), (513, 64), (15, 1), (31, 1)],
}


@pytest.mark.skipif(PLATFORM == "cpu", reason="needs a TPU or GPU")
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 16, 64)])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 256}, {"soft_cap": 30.0}])
def test_kernel_matches_the_reference_on_the_device(batch, dtype, heads, options):
    kernel = _kernel(resolve_attention_backend("pallas", PLATFORM))
    case = _case(np.random.default_rng(0), BATCHES[batch], *heads, 16, jnp.dtype(dtype))
    scale = heads[2] ** -0.5
    got = jax.jit(lambda *a: kernel(*a, sm_scale=scale, **options))(*case.args)
    want = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale, **options))(*case.args)
    # float32: both accumulate in float32 in a different order; bfloat16: outputs are rounded to
    # bfloat16 (8 bits of mantissa), so a few units in the last place of values of order 1.
    atol = 2e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol, rtol=0)


@pytest.mark.skipif(PLATFORM == "cpu", reason="needs a TPU or GPU")
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("pages", ["int8", "float8_e4m3fn"])
def test_kernel_reads_quantized_pages_as_the_reference_does(batch, pages):
    """bfloat16 queries over int8 / fp8 pages with their scales (--kv-cache-dtype), pages of 32
    tokens (a TPU packs 32 rows of a 1-byte dtype in a sublane tile)."""
    kernel = _kernel(resolve_attention_backend("pallas", PLATFORM))
    case = _case(np.random.default_rng(1), BATCHES[batch], 32, 8, 128, 32, jnp.bfloat16)
    case = case.quantized(pages, 0.03, 0.05)
    scale = 128**-0.5
    got = jax.jit(lambda *a: kernel(*a, sm_scale=scale, **case.scales))(*case.args)
    want = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale, **case.scales))(*case.args)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=0)
