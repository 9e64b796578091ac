"""The pre-norm transformer block of the vision encoders (SigLIP, Qwen2-VL's and Qwen2.5-VL's ViTs):
its stacked weights on a module and one block's step over one image's patches.

A block: norm -> q, k, v (with biases) -> optional rotary -> attention over the image's patches
(optionally masked) -> output projection; norm -> MLP (fc1, act, fc2; or gate and up, act on the
gate, down), each with a residual. The weights are stacked over the layers (`ln1_weight`,
`q_kernel`, ..., [layers, ...]) for one lax.scan. Under tensor parallelism (`tp_split`) the heads
and the MLP's intermediate axis split over the model axis.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.layers.rotary import apply_rope


def param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, init: str = "normal", axes=None) -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes or (None,) * len(shape))


def add_block_params(
    module: nnx.Module,
    rngs: nnx.Rngs,
    shape: tuple[int, int, int],  # (layers, width, MLP width)
    dtype,
    tp_split: bool,
    gated: bool = False,  # gate, up and down instead of fc1 and fc2
    norm_bias: bool = True,  # LayerNorm (weight and bias) or RMSNorm (weight)
) -> tuple[str, ...]:
    """Set the blocks' stacked weights on `module`; their names, for stacked_params."""
    n, d, m = shape
    heads, mlp = ("vision_heads", "vision_mlp") if tp_split else (None, None)
    # name: (shape, the split axis of its input, of its output)
    kernels = {p: ((d, d), None, heads) for p in "qkv"} | {"o": ((d, d), heads, None)}
    if gated:
        kernels |= {"gate": ((d, m), None, mlp), "up": ((d, m), None, mlp), "down": ((m, d), mlp, None)}
    else:
        kernels |= {"fc1": ((d, m), None, mlp), "fc2": ((m, d), mlp, None)}
    names = []
    for name, (kshape, split_in, split_out) in kernels.items():
        setattr(module, name + "_kernel", param(rngs, (n, *kshape), dtype, axes=(None, split_in, split_out)))
        setattr(module, name + "_bias", param(rngs, (n, kshape[1]), dtype, "zeros", (None, split_out)))
        names += [name + "_kernel", name + "_bias"]
    for name in ("ln1", "ln2"):
        setattr(module, name + "_weight", param(rngs, (n, d), dtype, "ones"))
        names.append(name + "_weight")
        if norm_bias:
            setattr(module, name + "_bias", param(rngs, (n, d), dtype, "zeros"))
            names.append(name + "_bias")
    return tuple(names)


def stacked_params(module: nnx.Module, names: tuple[str, ...]) -> dict[str, jax.Array]:
    return {name: getattr(module, name).value for name in names}


def block(
    x: jax.Array,  # [patches, width]
    w: dict[str, jax.Array],  # one layer's weights (stacked_params, sliced by the scan)
    num_heads: int,
    act: Callable,
    norm: Callable[[jax.Array, dict, str], jax.Array],  # (x, w, "ln1" or "ln2") -> normalized
    rope: tuple[jax.Array, jax.Array] | None = None,  # (positions per frequency, frequencies)
    keys: jax.Array | None = None,  # [patches, patches] or [patches] bool: the keys each query sees
) -> jax.Array:
    n, width = x.shape
    head_dim = width // num_heads
    h = norm(x, w, "ln1")
    q, k, v = ((h @ w[f"{p}_kernel"] + w[f"{p}_bias"]).reshape(n, num_heads, head_dim) for p in "qkv")
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * head_dim**-0.5
    if keys is not None:
        scores = jnp.where(keys if keys.ndim == 2 else keys[None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    attn = jnp.einsum("hqk,khd->qhd", probs, v).reshape(x.shape)
    x = x + attn @ w["o_kernel"] + w["o_bias"]
    h = norm(x, w, "ln2")
    if "gate_kernel" in w:
        hidden = act(h @ w["gate_kernel"] + w["gate_bias"]) * (h @ w["up_kernel"] + w["up_bias"])
        return x + hidden @ w["down_kernel"] + w["down_bias"]
    return x + act(h @ w["fc1_kernel"] + w["fc1_bias"]) @ w["fc2_kernel"] + w["fc2_bias"]
