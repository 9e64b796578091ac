"""transformers' activation names -> the function. gelu_new, gelu_fast, gelu_accurate and
gelu_pytorch_tanh are all the tanh approximation of GELU."""

from __future__ import annotations

import functools

import jax

_tanh_gelu = functools.partial(jax.nn.gelu, approximate=True)

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": _tanh_gelu,
    "gelu_fast": _tanh_gelu,
    "gelu_accurate": _tanh_gelu,
    "gelu_pytorch_tanh": _tanh_gelu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # (Qwen2-VL's vision MLP)
}
