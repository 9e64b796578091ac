"""Projections: x @ kernel (+ bias), with the kernel either in the model's dtype or quantized.

Weight-only quantization (`--quantization int8` or `fp8`) stores a projection kernel
[..., in, out] as int8 (or float8 e4m3) values and one float32 scale per output channel,
symmetric: kernel ~= values * scale. The values are cast to the activations' dtype inside the
jitted step and the scale is applied to the matmul's result, so the dequantized kernel exists
only as XLA chooses to (fused into the dot or a per-layer temporary), never in memory between
steps. Only the decoder layers' projections are quantized; embeddings, the LM head, routers,
norms and biases keep the model's dtype, as in vLLM's weight-only schemes (a GGUF file's Q8_0
embedding table excepted, see embedding_params).

A quantized kernel `q_proj` comes with a `q_proj_scale` parameter beside it (logical axes: the
kernel's without the input axis, so tensor parallelism shards the scales with their channels).

A quantized checkpoint's projections are served in their own values and groups: a GGUF file's
groups of 32 inputs (`q8`: Q8_0's int8 values and a scale per group; `q4`: Q4_0, Q4_1 and Q4_K's
4-bit values with a scale and a min per group, w = q * scale + min), and a checkpoint quantized
by another tool (loader/prequantized.py) in int8 or fp8 with a scale per output channel (`int8`,
`fp8`, as above) or per group of N inputs too (`int8/N`, `fp8/N`: scales [..., in / N, out]). 4-bit values are kept two per byte: the byte of row
64b + t holds that row (low nibble) and row 64b + 32 + t (high nibble), so each nibble is a
whole group and the two halves of the input feed two dots whose results add
(pallas_kernels/quantized_matmul: on a CPU, a native kernel with integer products, which
reads the bytes once instead of XLA's float32 copy of the kernel).
Their scales and mins are [..., in / 64, 2, out]: pairs of groups, the low nibbles' first.
Where that kernel runs, the runner puts the loaded stacks in its tiles of 64 output columns
(tile_q4_stacks): the same bytes, each tile contiguous.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.sharding import LOGICAL_AXIS_RULES
from pallas_kernels.quantized_matmul import TILE, q4_matmuls, q8_head, tile
from pallas_kernels.quantized_matmul.reference import dequantize_groups
from pallas_kernels.tracing import traced_platform

# --quantization -> (stored dtype, largest magnitude it holds)
WEIGHT_QUANTIZATIONS: dict[str, tuple[np.dtype, float]] = {
    "int8": (np.dtype(jnp.int8), 127.0),
    "fp8": (np.dtype(jnp.float8_e4m3fn), 448.0),
}
SCALE_SUFFIX = "_scale"
MIN_SUFFIX = "_min"
GROUP = 32  # inputs per group of a GGUF format
GROUPED_FORMATS = ("q8", "q4")
# The dense projections of the Llama-style layers, as they (and Hugging Face, and PEFT) name them:
# what a quantized checkpoint's own values are served in, and what a LoRA adapter may adapt
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS = LLAMA_PROJECTIONS
KV_PROJECTIONS = ("k_proj", "v_proj")  # whose outputs are KV heads (copied under wide tensor parallelism)
LORA_SUFFIXES = ("_lora_a", "_lora_b", "_lora_bias")


def group_rows(fmt: str | None) -> int:
    """Inputs that share a scale in a grouped format (a 4-bit pair of groups counts whole), 0 if
    the format has one scale per output channel (or is None)."""
    if fmt is not None and "/" in fmt:
        return int(fmt.partition("/")[2])
    return {"q4": 2 * GROUP, "q8": GROUP}.get(fmt, 0)


def kernel_params(
    rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype, quantization: str | None
) -> dict[str, nnx.Param]:
    """A projection kernel [..., in, out]'s parameters, by name suffix: {"": kernel} in `dtype`,
    or, quantized, {"": values, "_scale": [..., out] float32}. Random values for `dummy` loads
    (their dequantized spread is about the float init's 0.02)."""
    if quantization is None:
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
        return {"": nnx.Param(value, logical_axes=axes)}
    if quantization in GROUPED_FORMATS or "/" in quantization:
        return _grouped_params(rngs, shape, axes, quantization)
    stored, qmax = WEIGHT_QUANTIZATIONS[quantization]
    unit = jax.random.normal(rngs.params(), shape, jnp.float32)  # values of ~qmax/4 spread
    values = jnp.clip(unit * qmax / 4, -qmax, qmax)
    values = (jnp.round(values) if quantization == "int8" else values).astype(stored)
    scale = jnp.full(shape[:-2] + shape[-1:], 0.08 / qmax, jnp.float32)
    return {
        "": nnx.Param(values, logical_axes=axes),
        SCALE_SUFFIX: nnx.Param(scale, logical_axes=axes[:-2] + axes[-1:]),
    }


def _grouped_params(rngs: nnx.Rngs, shape, axes, fmt: str) -> dict[str, nnx.Param]:
    *lead, d_in, d_out = shape
    unit = jax.random.normal(rngs.params(), shape, jnp.float32)
    if fmt != "q4":  # int8 (or fp8) values in groups of `rows` inputs: q8, int8/N, fp8/N
        stored, qmax = WEIGHT_QUANTIZATIONS[fmt.partition("/")[0] if "/" in fmt else "int8"]
        rows = group_rows(fmt)
        if d_in % rows:
            raise ValueError(f"{d_in} inputs do not split into groups of {rows}.")
        values = jnp.clip(unit * qmax / 4, -qmax, qmax)
        values = (jnp.round(values) if stored == np.int8 else values).astype(stored)
        scale = jnp.full((*lead, d_in // rows, d_out), 0.08 / qmax, jnp.float32)
        return {"": nnx.Param(values, logical_axes=axes), SCALE_SUFFIX: nnx.Param(scale, logical_axes=axes)}
    if d_in % (2 * GROUP):
        raise ValueError(f"4-bit GGUF kernels need a multiple of {2 * GROUP} inputs, got {d_in}.")
    packed = jax.random.randint(rngs.params(), (*lead, d_in // 2, d_out), 0, 256).astype(jnp.uint8)
    group_shape, group_axes = (*lead, d_in // (2 * GROUP), 2, d_out), (*axes[:-1], None, axes[-1])
    return {
        "": nnx.Param(packed, logical_axes=axes),
        SCALE_SUFFIX: nnx.Param(jnp.full(group_shape, 0.006, jnp.float32), logical_axes=group_axes),
        MIN_SUFFIX: nnx.Param(jnp.full(group_shape, -0.045, jnp.float32), logical_axes=group_axes),
    }


# Projections that read the same input share one LoRA A parameter, so their (x A) is one matmul
# (q, k, v: the normed hidden state; gate, up: the MLP's input): "qkv_proj_lora_a", "gateup_proj_lora_a".
LORA_INPUT_GROUPS = (("q", "k", "v"), ("gate", "up"))


def lora_group(name: str) -> tuple[str, ...]:
    """The projections (short names) whose LoRA A parameter holds `name`'s, in order."""
    return next((g for g in LORA_INPUT_GROUPS if name in g), (name,))


def lora_a_members(group: str) -> tuple[str, ...]:
    """The projections (short names) of a LoRA A parameter "<group>_proj_lora_a", in order."""
    return next((g for g in LORA_INPUT_GROUPS if "".join(g) == group), (group,))


def lora_params(projections: Mapping[str, tuple[tuple[int, ...], tuple]], lora) -> dict[str, nnx.Param]:
    """The LoRA slots (`lora`: a LoRAConfig) of stacked projections (short name -> (kernel shape
    [layers, in, out], its logical axes)) by parameter name: per group of projections that read
    the same input, "<group>_proj_lora_a" [layers, slots, in, projections, rank]; per projection
    "<name>_proj_lora_b" [layers, slots, rank, out] (the adapter's scaling in B) and, with
    lora.bias, "<name>_proj_lora_bias" [layers, slots, out]; zero until an adapter is written
    into a slot. Sharded along the kernels' own in and out axes, so each device computes its part
    of the update beside its part of the projection; with lora.fully_sharded the rank axis of the
    factor that would be replicated (A of projections split by outputs, B of one split by inputs)
    is split too."""
    slots, rank = lora.max_loras, lora.max_lora_rank

    def rank_axis(other: str | None) -> str | None:
        return "lora_rank" if lora.fully_sharded and LOGICAL_AXIS_RULES.get(other) is None else None

    params = {}
    for group in dict.fromkeys(lora_group(name) for name in projections):
        (layers, d_in, _), axes = projections[group[0]]
        params[f"{''.join(group)}_proj_lora_a"] = nnx.Param(
            jnp.zeros((layers, slots, d_in, len(group), rank), jnp.float32),
            logical_axes=(axes[0], None, axes[1], None, rank_axis(axes[1])),
        )
        for name in group:
            (_, _, d_out), axes = projections[name]
            params[f"{name}_proj_lora_b"] = nnx.Param(
                jnp.zeros((layers, slots, rank, d_out), jnp.float32),
                logical_axes=(axes[0], None, rank_axis(axes[2]), axes[2]),
            )
            if lora.bias:
                params[f"{name}_proj_lora_bias"] = nnx.Param(
                    jnp.zeros((layers, slots, d_out), jnp.float32), logical_axes=(axes[0], None, axes[2])
                )
    return params


def lora_mask(lora_slots: jax.Array | None, lora) -> jax.Array | None:
    """Each token's LoRA slot ([tokens] int32, -1: the base model) -> [tokens, slots] one-hot
    float32 (a row of zeros for the base model); None without LoRA."""
    if lora_slots is None or lora is None:
        return None
    return (lora_slots[:, None] == jnp.arange(lora.max_loras, dtype=jnp.int32)).astype(jnp.float32)


def linear(x: jax.Array, w: Mapping[str, jax.Array], name: str, lora: jax.Array | None = None) -> jax.Array:
    """x @ w[name_proj] (+ w[name_bias]), with its LoRA update if `lora` (see linears)."""
    return linears(x, w, (name,), lora)[0]


def linears(
    x: jax.Array, w: Mapping[str, jax.Array], names: tuple[str, ...], lora: jax.Array | None = None
) -> list[jax.Array]:
    """x @ w[name_proj] (+ w[name_bias]) for each projection of `names`, all reading x; a
    quantized kernel is dequantized in the matmul. With LoRA slots (`lora`: [rows, slots], each
    row's slot one-hot, all zero for the base model), every row adds its own adapter's (x A) B:
    the products for all slots, masked per row (a few slots of a small rank cost a fraction of
    the projection), no gather and no recompile whatever the mix; the projections' A share one
    matmul."""
    if len(names) > 1 and all(_is_q4(w, name) for name in names):
        ys = _q4_projections(x, w, names)
    else:
        ys = [_project(x, w, name) for name in names]
    lora_a = w.get(f"{''.join(names)}_proj_lora_a")
    if lora_a is not None and lora is not None:
        xa = jnp.einsum("ti,sipr->tpsr", x.astype(jnp.float32), lora_a) * lora[:, None, :, None]
        for p, name in enumerate(names):
            delta = jnp.einsum("tsr,sro->to", xa[:, p], w[f"{name}_proj_lora_b"])
            lora_bias = w.get(f"{name}_proj_lora_bias")
            if lora_bias is not None:
                delta = delta + lora @ lora_bias
            ys[p] = ys[p] + delta.astype(ys[p].dtype)
    return [y if (bias := w.get(f"{name}_bias")) is None else y + bias for y, name in zip(ys, names)]


def _project(x: jax.Array, w: Mapping[str, jax.Array], name: str) -> jax.Array:
    """x @ w[name_proj], the kernel dequantized in the matmul if quantized."""
    kernel = w[f"{name}_proj"]
    scale = w.get(f"{name}_proj{SCALE_SUFFIX}")
    if scale is None:
        return x @ kernel
    if scale.ndim < kernel.ndim:  # one scale per output channel
        return (jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32) * scale).astype(
            x.dtype
        )
    if scale.ndim == kernel.ndim:  # int8 or fp8 in groups of inputs: q8, int8/N, fp8/N
        return jnp.dot(x.astype(jnp.float32), dequantize_groups(kernel, scale)).astype(x.dtype)
    # q4: two 4-bit values a byte, each nibble a half of the groups (pallas_kernels/quantized_matmul)
    return _q4_projections(x, w, (name,))[0]


def _is_q4(w: Mapping[str, jax.Array], name: str) -> bool:
    return f"{name}_proj{MIN_SUFFIX}" in w


def _q4_projections(x: jax.Array, w: Mapping[str, jax.Array], names: tuple[str, ...]) -> list[jax.Array]:
    """x @ each q4 projection of `names`, in one kernel call where the kernel runs."""
    suffixes = ("", SCALE_SUFFIX, MIN_SUFFIX)
    if isinstance(w, LayerWeights):  # the whole stacks and the layer's index: no copy of the slice
        stacks = [tuple(w.stack(f"{n}_proj{s}") for s in suffixes) for n in names]
        index = w.index
    else:
        stacks = [tuple(w[f"{n}_proj{s}"][None] for s in suffixes) for n in names]
        index = jnp.int32(0)
    flat = x.reshape(-1, x.shape[-1])
    ys = q4_matmuls(flat.astype(jnp.float32), stacks, index)
    return [y.reshape(*x.shape[:-1], -1).astype(x.dtype) for y in ys]


def on_device(tree):
    """The arrays of `tree`, each copied into device memory inside the step if it lives in host
    memory (CPU weight offload: runner/offload.py); the others as they are."""

    def one(x):
        if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
            return jax.device_put(x, jax.memory.Space.Device)
        return x

    return jax.tree.map(one, tree)


class LayerWeights(Mapping):
    """One decoder layer's weights as a mapping, w[name] its slice of the stack [layers, ...]: most
    come sliced by the layer scan (`sliced`), a 4-bit kernel's stacks whole with the layer's index
    (`stacks`, `index`), so that XLA copies no slice out before the native kernel's call."""

    def __init__(self, sliced: Mapping[str, jax.Array], stacks: Mapping[str, jax.Array], index: jax.Array):
        self._sliced, self._stacks = sliced, stacks
        self.index = index  # [] int32

    @staticmethod
    def split(stacked: Mapping[str, jax.Array]) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        """The stacks the scan slices, and those a kernel takes whole (each 4-bit projection's)."""
        whole = {
            name + suffix
            for name in stacked
            if name.endswith("_proj") and name + MIN_SUFFIX in stacked
            for suffix in ("", SCALE_SUFFIX, MIN_SUFFIX)
        }
        return {k: v for k, v in stacked.items() if k not in whole}, {k: stacked[k] for k in whole}

    def __getitem__(self, name: str) -> jax.Array:
        if name in self._sliced:
            return on_device(self._sliced[name])
        return self._stacks[name][self.index]

    def __contains__(self, name: object) -> bool:
        return name in self._sliced or name in self._stacks

    def __iter__(self):
        yield from self._sliced
        yield from self._stacks

    def __len__(self) -> int:
        return len(self._sliced) + len(self._stacks)

    def stack(self, name: str) -> jax.Array:
        return self._stacks[name]


# An embedding table kept in a GGUF file's Q8_0 groups (`embed_tokens` in "q8"): int8 values
# [vocab, hidden] and a float32 scale per 32 hidden values [vocab, hidden / 32], a quarter of the
# float32 table's bytes. A lookup dequantizes only the rows it reads. A tied LM head multiplies
# by the whole table: XLA fuses the dequantization into a matrix-vector product for a few rows
# (faster than float32: a quarter of the bytes read), but for more rows XLA:CPU would write a
# float32 copy of the table before the dot, so there it goes HEAD_CHUNK_ROWS vocabulary rows at a
# time and each float32 chunk stays in cache (benchmarks/quantized_head.py).
HEAD_WHOLE_MAX_ROWS = 1
HEAD_CHUNK_ROWS = 1024
# On one CPU device the native kernel (pallas_kernels/quantized_matmul q8_head) reads the int8 table
# once for every row instead: 2.5x faster than XLA's fused product at one row, 5x-8x than the chunks
# at 2-4 rows (a step verifying proposed tokens), 1.5x at 16, level at 32
# (benchmarks/quantized_head.py, results/quantized_head_kernel_cpu.json).
HEAD_KERNEL_MAX_ROWS = 16


def embedding_params(rngs: nnx.Rngs, vocab: int, hidden: int, dtype, fmt: str | None) -> dict[str, nnx.Param]:
    """The embedding table's parameters by name suffix: {"": [vocab, hidden] in `dtype`}, or in
    Q8_0 groups {"": int8 values, "_scale": [vocab, hidden / 32] float32}."""
    unit = jax.random.normal(rngs.params(), (vocab, hidden), jnp.float32)
    if fmt is None:
        return {"": nnx.Param((0.02 * unit).astype(dtype), logical_axes=("vocab", "embed"))}
    if fmt != "q8" or hidden % GROUP:
        raise ValueError(f"An embedding table is kept quantized only in Q8_0 groups of {GROUP}, not {fmt!r}.")
    values = jnp.round(jnp.clip(unit * 32, -127, 127)).astype(jnp.int8)  # dequantized spread ~0.02
    return {
        "": nnx.Param(values, logical_axes=("vocab", "embed")),
        SCALE_SUFFIX: nnx.Param(
            jnp.full((vocab, hidden // GROUP), 0.02 / 32, jnp.float32), logical_axes=("vocab", None)
        ),
    }


def _dequantize_rows(values: jax.Array, scale: jax.Array) -> jax.Array:
    """Q8_0 rows [n, hidden] with their scales [n, hidden / 32] -> float32."""
    n, hidden = values.shape
    return (values.reshape(n, -1, GROUP).astype(jnp.float32) * scale[..., None]).reshape(n, hidden)


def embed(table: jax.Array, scale: jax.Array | None, ids: jax.Array, dtype) -> jax.Array:
    """The rows of the embedding table for `ids`, in `dtype`."""
    if scale is None:
        return table[ids]
    return _dequantize_rows(table[ids], scale[ids]).astype(dtype)


def tied_head(x: jax.Array, table: jax.Array, scale: jax.Array | None) -> jax.Array:
    """x [rows, hidden] @ table.T -> float32 logits [rows, vocab] (the LM head of a model whose
    head is its embedding table)."""
    if scale is None:
        return jnp.dot(x, table.T, preferred_element_type=jnp.float32)
    x = x.astype(jnp.float32)
    if x.shape[0] <= HEAD_KERNEL_MAX_ROWS:
        logits = q8_head(x, table, scale)  # the native CPU kernel, where it runs
        if logits is not None:
            return logits
    if x.shape[0] <= HEAD_WHOLE_MAX_ROWS or traced_platform() != "cpu":
        return x @ _dequantize_rows(table, scale).T
    axis = LOGICAL_AXIS_RULES["vocab"]
    mesh = jax.sharding.get_abstract_mesh()  # the mesh the step is traced under, if any
    if mesh.empty or mesh.shape.get(axis, 1) == 1:
        return _chunked_head(x, table, scale)
    spec = jax.sharding.PartitionSpec(axis)  # each device its own vocabulary rows
    whole = jax.sharding.PartitionSpec()
    head = jax.shard_map(
        _chunked_head,
        mesh=mesh,
        in_specs=(whole, spec, spec),
        out_specs=jax.sharding.PartitionSpec(None, axis),
    )
    return head(x, table, scale)


def _chunked_head(x: jax.Array, table: jax.Array, scale: jax.Array) -> jax.Array:
    vocab, hidden = table.shape
    if vocab % HEAD_CHUNK_ROWS:
        return x @ _dequantize_rows(table, scale).T
    chunks = vocab // HEAD_CHUNK_ROWS
    parts = jax.lax.map(
        lambda c: x @ _dequantize_rows(*c).T,
        (table.reshape(chunks, HEAD_CHUNK_ROWS, hidden), scale.reshape(chunks, HEAD_CHUNK_ROWS, -1)),
    )  # [chunks, rows, HEAD_CHUNK_ROWS]
    return jnp.moveaxis(parts, 0, 1).reshape(x.shape[0], vocab)


def pack_q4(values: np.ndarray, scale: np.ndarray, mins: np.ndarray):
    """Host-side: 4-bit values [..., in, out] (one per byte) with scales and mins [..., in / 32,
    out] -> the served layout (see the module docstring): bytes [..., in / 2, out] and scales
    and mins [..., in / 64, 2, out]."""
    *lead, d_in, d_out = values.shape
    pairs = values.reshape(*lead, d_in // (2 * GROUP), 2, GROUP, d_out)
    packed = (pairs[..., 0, :, :] | (pairs[..., 1, :, :] << 4)).reshape(*lead, d_in // 2, d_out)

    def split(groups):
        return groups.reshape(*lead, d_in // (2 * GROUP), 2, d_out)

    return packed.astype(np.uint8), split(scale), split(mins)


def tile_q4_stacks(state: nnx.State) -> nnx.State:
    """A loaded state's 4-bit stacks (those whose width is a multiple of 64) in the native CPU
    kernel's tiles (pallas_kernels/quantized_matmul/reference.py), each replacing its stack."""
    flat = dict(nnx.to_flat_state(state))
    retile = jax.jit(tile, donate_argnums=(0, 1, 2))
    for path in [p for p in flat if str(p[-1]).endswith(MIN_SUFFIX)]:
        kernel = path[:-1] + (str(path[-1]).removesuffix(MIN_SUFFIX),)
        parts = [flat[kernel], flat[kernel[:-1] + (kernel[-1] + SCALE_SUFFIX,)], flat[path]]
        if parts[0].value.ndim == 3 and parts[0].value.shape[-1] % TILE == 0:
            for var, value in zip(parts, retile(*(var.value for var in parts))):
                var.value = value
    return nnx.from_flat_state(flat)


def quantize_kernel(kernel: np.ndarray, quantization: str) -> tuple[np.ndarray, np.ndarray]:
    """Host-side: a float kernel [..., in, out] -> (values, scale [..., out] float32), symmetric,
    one scale per output channel (its largest magnitude maps to the dtype's). Works one leading
    index at a time, so a stacked model never needs a second float copy of a whole tensor."""
    stored, qmax = WEIGHT_QUANTIZATIONS[quantization]
    values = np.empty(kernel.shape, stored)
    scale = np.empty(kernel.shape[:-2] + kernel.shape[-1:], np.float32)
    for index in np.ndindex(kernel.shape[:-2]):
        w = np.asarray(kernel[index], np.float32)
        amax = np.abs(w).max(axis=0)
        s = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
        v = w / s
        values[index] = np.clip(np.rint(v), -qmax, qmax) if quantization == "int8" else v
        scale[index] = s
    return values, scale
