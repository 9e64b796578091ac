"""--attention-backend: which ragged paged attention each platform traces, and what is refused."""

from __future__ import annotations

import pytest

from jaxserve.layers.attention import resolve_attention_backend


@pytest.mark.parametrize(
    "requested, platform, traced",
    [
        ("auto", "cpu", "reference"),
        ("auto", "tpu", "tpu"),
        ("auto", "gpu", "gpu"),
        ("reference", "tpu", "reference"),
        ("pallas", "tpu", "tpu"),
        ("pallas", "gpu", "gpu"),
        ("pallas-tpu-interpret", "cpu", "tpu-interpret"),
        ("pallas-gpu-interpret", "cpu", "gpu-interpret"),
    ],
)
def test_backend_for_the_platform(requested, platform, traced):
    assert resolve_attention_backend(requested, platform) == traced


def test_a_kernel_where_there_is_none_is_refused_in_one_line():
    with pytest.raises(
        ValueError, match=r"^--attention-backend pallas needs a TPU or GPU; this platform is 'cpu'"
    ) as e:
        resolve_attention_backend("pallas", "cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="must be one of auto, reference, pallas"):
        resolve_attention_backend("flash", "gpu")
