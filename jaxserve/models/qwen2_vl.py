"""Qwen2-VL: a vision encoder before the Qwen2 decoder, whose rope turns each frequency by one of
a token's three positions (M-RoPE: time, height, width; an image's tokens take their grid's, text
the same position three times; layers/rotary.py mrope_rows). The decoder is LlamaForCausalLM with
Qwen2's switches and the sections; the encoder is below.

The vision encoder: a ViT over 14x14 (x2 frames) patches with an axial 2D rotary
embedding, full attention within one image, then a patch merger that turns each 2x2 block of
neighbouring patches into one row in the text embedding space.

The image processor emits an image's patches block-major (the patches of one merge block are
consecutive), with `jaxserve.multimodal.vision_positions` giving each one's (h, w) index. `encode_image` takes one
image's patches padded to a bucket of N rows; the rows past `num_valid` are zeroed and masked out
of attention as keys, so the padding never changes the real rows' result.

Checkpoint tensors are under `visual.` (transformers keeps that prefix when it saves, though its
module is `model.visual`). The fused qkv projection is split into q, k and v at load
(`split_vision_tensor`), so that tensor parallelism splits each of them by heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.layers.activation import ACTIVATIONS
from jaxserve.layers.rotary import mrope_rows
from jaxserve.layers.vit import add_block_params, block, param, stacked_params
from jaxserve.models.llama import LlamaArgs, LlamaForCausalLM
from jaxserve.models.opt import layer_norm
from jaxserve.models.qwen2 import qwen2_args

_EPS = 1e-6  # every LayerNorm of the encoder and the merger


@dataclass(frozen=True)
class Qwen2VLVisionArgs:
    embed_dim: int
    depth: int
    num_heads: int
    intermediate_size: int  # embed_dim * mlp_ratio
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    spatial_merge_size: int
    hidden_act: str
    rope_theta: float
    out_hidden: int  # the merger's output: the text model's hidden size
    image_token_id: int
    # heads and MLP split over the model axis (tensor parallel, when both divide); else whole
    tp_split: bool = False

    @classmethod
    def from_hf(cls, hf: Mapping) -> Qwen2VLVisionArgs:
        """From the top-level config: vision_config, and the text hidden size (vision_config's
        hidden_size, which the merger projects to; else text_config's or the flattened top level's)."""
        v = hf["vision_config"]
        text = hf.get("text_config") or {}
        out_hidden = v.get("hidden_size") or text.get("hidden_size") or hf["hidden_size"]
        rope = v.get("rope_parameters") or {}
        return cls(
            embed_dim=v["embed_dim"],
            depth=v["depth"],
            num_heads=v["num_heads"],
            intermediate_size=int(v["embed_dim"] * v.get("mlp_ratio", 4)),
            patch_size=v.get("patch_size", 14),
            temporal_patch_size=v.get("temporal_patch_size", 2),
            in_channels=v.get("in_channels", v.get("in_chans", 3)),  # older configs: in_chans
            spatial_merge_size=v.get("spatial_merge_size", 2),
            hidden_act=v.get("hidden_act", "quick_gelu"),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
            out_hidden=out_hidden,
            image_token_id=hf.get("image_token_id", text.get("image_token_id", 151655)),
        )

    @property
    def patch_dim(self) -> int:
        """One patch's values: channels x frames x patch x patch, as the processor flattens it."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def merge_dim(self) -> int:
        """The merger's input: one merge block's patches side by side."""
        return self.embed_dim * self.spatial_merge_size**2


class Qwen2VisionTower(nnx.Module):
    """The patch embedding, the blocks (stacked, run by one scan) and the patch merger. Under
    tensor parallelism each device holds its share of the heads and of the MLP (when they split
    evenly; else the whole encoder); the merger is whole on each device."""

    def __init__(self, v: Qwen2VLVisionArgs, dtype, rngs: nnx.Rngs):
        d = v.embed_dim
        self.patch_kernel = param(rngs, (v.patch_dim, d), dtype)
        self._block_names = add_block_params(self, rngs, (v.depth, d, v.intermediate_size), dtype, v.tp_split)
        self.merger_ln_weight = param(rngs, (d,), dtype, "ones")
        self.merger_ln_bias = param(rngs, (d,), dtype, "zeros")
        add_merger_params(self, rngs, v, dtype)

    def stacked(self) -> dict[str, jax.Array]:
        return stacked_params(self, self._block_names)


def add_merger_params(module: nnx.Module, rngs: nnx.Rngs, v: Qwen2VLVisionArgs, dtype) -> None:
    """The patch merger's MLP (whole on each device): merge block -> merge block -> text width."""
    module.merger_fc1_kernel = param(rngs, (v.merge_dim, v.merge_dim), dtype)
    module.merger_fc1_bias = param(rngs, (v.merge_dim,), dtype, "zeros")
    module.merger_fc2_kernel = param(rngs, (v.merge_dim, v.out_hidden), dtype)
    module.merger_fc2_bias = param(rngs, (v.out_hidden,), dtype, "zeros")


def _rope_tables(v: Qwen2VLVisionArgs, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[N, head_dim // 2] float32 positions per frequency and [head_dim // 2] frequencies for
    apply_rope: the first quarter of the head's frequencies turn with the row, the second with
    the column (the same head_dim // 4 frequencies for each), as Qwen2VLVisionRotaryEmbedding."""
    quarter = v.head_dim // 4
    inv_freq = 1.0 / (v.rope_theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter)))
    inv_freq = jnp.asarray(np.concatenate([inv_freq, inv_freq]).astype(np.float32))
    per_freq = jnp.repeat(positions.astype(jnp.float32), quarter, axis=-1)  # [N, 2 * quarter]: h.., w..
    return per_freq, inv_freq


def _merge(tower: Qwen2VisionTower, v: Qwen2VLVisionArgs, x: jax.Array) -> jax.Array:
    """PatchMerger: LayerNorm, then merger_mlp."""
    return merger_mlp(tower, v, layer_norm(x, tower.merger_ln_weight.value, tower.merger_ln_bias.value, _EPS))


def merger_mlp(tower: nnx.Module, v: Qwen2VLVisionArgs, x: jax.Array) -> jax.Array:
    """The patch merger after its norm: each merge block's patches side by side, Linear, exact
    GELU, Linear (add_merger_params' weights) -> [blocks, text width] float32."""
    x = x.reshape(-1, v.merge_dim)
    h = jax.nn.gelu(x @ tower.merger_fc1_kernel.value + tower.merger_fc1_bias.value, approximate=False)
    out = jnp.dot(h, tower.merger_fc2_kernel.value, preferred_element_type=jnp.float32)
    return out + tower.merger_fc2_bias.value.astype(jnp.float32)


def encode_image(
    tower: Qwen2VisionTower,
    v: Qwen2VLVisionArgs,
    patches: jax.Array,
    positions: jax.Array,
    num_valid: jax.Array,
) -> jax.Array:
    """patches [N, patch_dim] (N a multiple of merge**2; rows past num_valid are padding),
    positions [N, 2] int32 -> [N // merge**2, out_hidden] float32, transformers' pooler_output
    for the image's num_valid patches in the first num_valid // merge**2 rows (the rest zero)."""
    dtype = tower.patch_kernel.value.dtype
    valid = jnp.arange(patches.shape[0]) < num_valid
    x = jnp.where(valid[:, None], patches, 0).astype(dtype) @ tower.patch_kernel.value
    rope = _rope_tables(v, positions)
    act = ACTIVATIONS[v.hidden_act]

    def norm(x, w, name):
        return layer_norm(x, w[name + "_weight"], w[name + "_bias"], _EPS)

    def layer(x, w):
        return block(x, w, v.num_heads, act, norm, rope, valid), None

    x, _ = jax.lax.scan(layer, x, tower.stacked())
    out = _merge(tower, v, x)
    rows_valid = jnp.arange(out.shape[0]) < num_valid // v.spatial_merge_size**2
    return jnp.where(rows_valid[:, None], out, 0.0)


def vision_weight_map(
    v: Qwen2VLVisionArgs,
    prefix: str = "visual.",
    ours: str = "vision.",
    gated: bool = False,  # Qwen2.5-VL's MLP: gate, up and down projections
    norm_bias: bool = True,  # LayerNorm (weight and bias); Qwen2.5-VL's RMSNorm: weight only
) -> dict[str, tuple[str, int | None, bool]]:
    """The checkpoint's vision tensors (after split_vision_tensor) -> (our parameter path, layer
    index or None, transpose)."""
    norm_parts = ("weight", "bias") if norm_bias else ("weight",)
    table = {prefix + "patch_embed.proj.weight": (ours + "patch_kernel", None, True)}
    for part in norm_parts:
        table[f"{prefix}merger.ln_q.{part}"] = (f"{ours}merger_ln_{part}", None, False)
    for hf, name in (("mlp.0", "merger_fc1"), ("mlp.2", "merger_fc2")):
        table[f"{prefix}merger.{hf}.weight"] = (f"{ours}{name}_kernel", None, True)
        table[f"{prefix}merger.{hf}.bias"] = (f"{ours}{name}_bias", None, False)
    per_layer = {f"attn.{p}": p for p in "qkv"} | {"attn.proj": "o"}
    mlp = (
        {f"mlp.{p}_proj": p for p in ("gate", "up", "down")}
        if gated
        else {"mlp.fc1": "fc1", "mlp.fc2": "fc2"}
    )
    per_layer |= mlp
    for i in range(v.depth):
        block = f"{prefix}blocks.{i}."
        for hf, name in per_layer.items():
            table[block + hf + ".weight"] = (f"{ours}{name}_kernel", i, True)
            table[block + hf + ".bias"] = (f"{ours}{name}_bias", i, False)
        for n in ("1", "2"):
            for part in norm_parts:
                table[f"{block}norm{n}.{part}"] = (f"{ours}ln{n}_{part}", i, False)
    return table


def split_vision_tensor(name: str, tensor) -> Iterator[tuple[str, np.ndarray]]:
    """A checkpoint tensor as vision_weight_map names it: the Conv3d patch kernel as the matmul it
    is ([embed, channels * frames * patch * patch]); the fused qkv weight and bias as three
    tensors, `attn.q`, `attn.k` and `attn.v`. Every other tensor as it is."""
    if name.endswith("patch_embed.proj.weight"):
        yield name, np.asarray(tensor).reshape(tensor.shape[0], -1)
    elif name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        base, kind = name.rsplit(".qkv.", 1)
        for part, value in zip("qkv", np.split(np.asarray(tensor), 3, axis=0), strict=True):
            yield f"{base}.{part}.{kind}", value
    else:
        yield name, tensor


@dataclass(frozen=True)
class Qwen2VLArgs(LlamaArgs):
    vision: Qwen2VLVisionArgs | None = None


def qwen2_vl_args(hf: Mapping, max_model_len: int) -> Qwen2VLArgs:
    """The decoder's args from the config's text part (flattened into the top level by
    model_resolution), with the rope's sections; the encoder's from vision_config."""
    text = qwen2_args(hf, max_model_len)
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text)}
    return Qwen2VLArgs(**fields | {"mrope_rows": mrope_rows(hf)}, vision=Qwen2VLVisionArgs.from_hf(hf))


def qwen2_vl_names(name: str, tensor, args: Qwen2VLArgs) -> Iterator[tuple[str, np.ndarray]]:
    """Checkpoints name the decoder `model.language_model.*` (transformers 5) or `model.*`, the
    encoder `visual.*` or `model.visual.*`: one form of each."""
    if name.startswith("model.language_model."):
        name = "model." + name.removeprefix("model.language_model.")
    elif name.startswith("model.visual."):
        name = name.removeprefix("model.")
    if name.startswith("visual."):
        yield from split_vision_tensor(name, tensor)
    else:
        yield name, tensor


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, args: Qwen2VLArgs, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(args, dtype=dtype, rngs=rngs)
        self.vision = Qwen2VisionTower(args.vision, dtype, rngs)

    def image_call(self, patches: jax.Array, positions: jax.Array, num_valid: jax.Array) -> jax.Array:
        """The encoder's unit of work (runner/image_encoder.py): one image's patches, padded to a
        bucket, -> its rows (the first num_valid // merge**2)."""
        return encode_image(self.vision, self.args.vision, patches, positions, num_valid)

    @staticmethod
    def image_call_shapes(args: Qwen2VLArgs) -> list[tuple[jax.ShapeDtypeStruct, ...]]:
        """The calls start-up compiles: images of up to 4096 patches (a 896x896 picture at
        14x14 patches), in power-of-two buckets from 64; larger ones compile when first seen."""
        v = args.vision
        return [
            (
                jax.ShapeDtypeStruct((n, v.patch_dim), jnp.float32),
                jax.ShapeDtypeStruct((n, 2), jnp.int32),
                jax.ShapeDtypeStruct((), jnp.int32),
            )
            for n in (64 << i for i in range(7))
        ]

    @staticmethod
    def hf_weight_map(args: Qwen2VLArgs) -> dict[str, tuple[str, int | tuple[int, int] | None, bool]]:
        return LlamaForCausalLM.hf_weight_map(args) | vision_weight_map(args.vision)
