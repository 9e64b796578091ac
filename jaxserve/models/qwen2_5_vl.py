"""Qwen2.5-VL: Qwen2-VL's design (models/qwen2_vl.py) with another vision encoder. The decoder is
the same (Qwen2 with M-RoPE sections), as are the image processing, the image tokens and their
positions (multimodal/qwen2_vl_processor.py), the 2D rope of the encoder's heads and the patch
merger's shape.

The encoder: RMSNorm in place of LayerNorm (the blocks' and the merger's), a gated MLP
(down(act(gate(x)) * up(x)), with biases), and window attention. The image's merged units (its
merge x merge patch blocks, one image token each) are reordered window by window before the
blocks (multimodal/qwen2_5_vl_windows.py); the blocks of `fullatt_block_indexes` attend over the
whole image, the others within a window; the merger's rows are put back in the processor's
order. The merger projects to `out_hidden_size`.

`encode_image_windowed` takes one image's patches padded to a bucket of N rows, with the window
order and each unit's window computed on the host, so that one compiled program per bucket serves
every image size and shape: a key counts where it is one of the image's patches and, in a
windowed block, in the query's window. Padding rows are zeroed and never a key, so they change
nothing of the image's rows.

Checkpoints name the encoder `visual.*` (transformers 5 saves it so too) and the decoder `model.*`
(or `model.language_model.*`), as Qwen2-VL's: qwen2_vl_names reads them, split_vision_tensor cuts
the patch kernel and the fused qkv.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.layers.activation import ACTIVATIONS
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rotary import mrope_rows
from jaxserve.layers.vit import add_block_params, block, param, stacked_params
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.qwen2 import qwen2_args
from jaxserve.models.qwen2_vl import (
    Qwen2VLArgs,
    Qwen2VLVisionArgs,
    _rope_tables,
    add_merger_params,
    merger_mlp,
    qwen2_vl_names,
)
from jaxserve.models.qwen2_vl import vision_weight_map as qwen2_vl_weight_map

_EPS = 1e-6  # every RMSNorm of the encoder and the merger

# The checkpoint's names are Qwen2-VL's: `visual.*` and the decoder's two spellings.
qwen2_5_vl_names = qwen2_vl_names


@dataclass(frozen=True)
class Qwen2_5_VLVisionArgs(Qwen2VLVisionArgs):
    window_size: int = 112  # a window's side in pixels
    fullatt_block_indexes: tuple[int, ...] = ()  # the blocks that attend over the whole image

    @classmethod
    def from_hf(cls, hf: Mapping) -> Qwen2_5_VLVisionArgs:
        """From the top-level config: vision_config (whose hidden_size is the encoder's width and
        out_hidden_size the merger's output), with Qwen2_5_VLVisionConfig's defaults."""
        v = hf["vision_config"]
        text = hf.get("text_config") or {}
        rope = v.get("rope_parameters") or {}
        return cls(
            embed_dim=v["hidden_size"],
            depth=v["depth"],
            num_heads=v["num_heads"],
            intermediate_size=v["intermediate_size"],
            patch_size=v.get("patch_size", 14),
            temporal_patch_size=v.get("temporal_patch_size", 2),
            in_channels=v.get("in_channels", v.get("in_chans", 3)),  # older configs: in_chans
            spatial_merge_size=v.get("spatial_merge_size", 2),
            hidden_act=v.get("hidden_act", "silu"),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
            out_hidden=v.get("out_hidden_size") or text.get("hidden_size") or hf["hidden_size"],
            image_token_id=hf.get("image_token_id", text.get("image_token_id", 151655)),
            window_size=v.get("window_size", 112),
            fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        )

    @property
    def merger_window(self) -> int:
        """Merged units per side of a window (transformers' vit_merger_window_size)."""
        return self.window_size // self.spatial_merge_size // self.patch_size


class Qwen2_5_VisionTower(nnx.Module):
    """The patch embedding, the blocks (stacked, run by one scan) and the patch merger. Under
    tensor parallelism each device holds its share of the heads and of the MLP (when they split
    evenly; else the whole encoder); the merger is whole on each device."""

    def __init__(self, v: Qwen2_5_VLVisionArgs, dtype, rngs: nnx.Rngs):
        d = v.embed_dim
        self.patch_kernel = param(rngs, (v.patch_dim, d), dtype)
        shape = (v.depth, d, v.intermediate_size)
        self._block_names = add_block_params(
            self, rngs, shape, dtype, v.tp_split, gated=True, norm_bias=False
        )
        self.merger_ln_weight = param(rngs, (d,), dtype, "ones")
        add_merger_params(self, rngs, v, dtype)

    def stacked(self) -> dict[str, jax.Array]:
        return stacked_params(self, self._block_names)


def _merge(tower: Qwen2_5_VisionTower, v: Qwen2_5_VLVisionArgs, x: jax.Array) -> jax.Array:
    """PatchMerger: RMSNorm, then Qwen2-VL's merger_mlp."""
    return merger_mlp(tower, v, rms_norm(x, tower.merger_ln_weight.value, _EPS))


def encode_image_windowed(
    tower: Qwen2_5_VisionTower,
    v: Qwen2_5_VLVisionArgs,
    patches: jax.Array,
    positions: jax.Array,
    num_valid: jax.Array,
    window_index: jax.Array,
    window_ids: jax.Array,
) -> jax.Array:
    """patches [N, patch_dim] in the processor's order (N a multiple of merge**2; rows past
    num_valid are padding), positions [N, 2] int32, window_index [N // merge**2] int32 (a
    permutation of the units: the window order, multimodal/qwen2_5_vl_windows.py) and window_ids
    [N // merge**2] int32 (the window of each unit in that order) -> [N // merge**2, out_hidden]
    float32, transformers' pooler_output for the image's num_valid patches in the first
    num_valid // merge**2 rows (the rest zero)."""
    dtype = tower.patch_kernel.value.dtype
    n, unit = patches.shape[0], v.spatial_merge_size**2

    def windowed(a: jax.Array) -> jax.Array:  # rows in the processor's order -> in window order
        return a.reshape(n // unit, unit, *a.shape[1:])[window_index].reshape(a.shape)

    valid = windowed(jnp.arange(n) < num_valid)
    x = jnp.where(valid[:, None], windowed(patches), 0).astype(dtype) @ tower.patch_kernel.value
    per_freq, inv_freq = _rope_tables(v, windowed(positions))
    ids = jnp.repeat(window_ids, unit)
    # keys a query sees: the image's own, within its window in a windowed block (a padding query,
    # whose row is dropped, sees them all, so that no row of the softmax is empty)
    whole = jnp.broadcast_to(valid[None, :], (n, n))
    in_window = whole & ((ids[:, None] == ids[None, :]) | ~valid[:, None])
    full = np.isin(np.arange(v.depth), v.fullatt_block_indexes)
    act = ACTIVATIONS[v.hidden_act]

    def norm(x, w, name):
        return rms_norm(x, w[name + "_weight"], _EPS)

    def layer(x, layer_in):
        w, full_attention = layer_in
        keys = jnp.where(full_attention, whole, in_window)
        return block(x, w, v.num_heads, act, norm, (per_freq, inv_freq), keys), None

    x, _ = jax.lax.scan(layer, x, (tower.stacked(), jnp.asarray(full)))
    merged = _merge(tower, v, x)  # [units] in window order
    out = jnp.zeros_like(merged).at[window_index].set(merged)  # back in the processor's order
    rows_valid = jnp.arange(out.shape[0]) < num_valid // unit
    return jnp.where(rows_valid[:, None], out, 0.0)


def vision_weight_map(
    v: Qwen2_5_VLVisionArgs, prefix: str = "visual.", ours: str = "vision."
) -> dict[str, tuple[str, int | None, bool]]:
    """Qwen2-VL's map with the gated MLP and the RMSNorms' weights."""
    return qwen2_vl_weight_map(v, prefix, ours, gated=True, norm_bias=False)


def qwen2_5_vl_args(hf: Mapping, max_model_len: int) -> Qwen2VLArgs:
    """The decoder's args from the config's text part (flattened into the top level by
    model_resolution), with the rope's sections; the encoder's from vision_config."""
    text = qwen2_args(hf, max_model_len)
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text)}
    return Qwen2VLArgs(**fields | {"mrope_rows": mrope_rows(hf)}, vision=Qwen2_5_VLVisionArgs.from_hf(hf))


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, args: Qwen2VLArgs, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(args, dtype=dtype, rngs=rngs)
        self.vision = Qwen2_5_VisionTower(args.vision, dtype, rngs)

    def image_call(
        self,
        patches: jax.Array,
        positions: jax.Array,
        num_valid: jax.Array,
        window_index: jax.Array,
        window_ids: jax.Array,
    ) -> jax.Array:
        """The encoder's unit of work (runner/image_encoder.py): one image's patches, padded to a
        bucket, with its window order -> its rows (the first num_valid // merge**2)."""
        return encode_image_windowed(
            self.vision, self.args.vision, patches, positions, num_valid, window_index, window_ids
        )

    @staticmethod
    def image_call_shapes(args: Qwen2VLArgs) -> list[tuple[jax.ShapeDtypeStruct, ...]]:
        """The calls start-up compiles: images of up to 4096 patches (a 896x896 picture at
        14x14 patches), in power-of-two buckets from 64; larger ones compile when first seen."""
        v = args.vision
        units = v.spatial_merge_size**2
        return [
            (
                jax.ShapeDtypeStruct((n, v.patch_dim), jnp.float32),
                jax.ShapeDtypeStruct((n, 2), jnp.int32),
                jax.ShapeDtypeStruct((), jnp.int32),
                jax.ShapeDtypeStruct((n // units,), jnp.int32),
                jax.ShapeDtypeStruct((n // units,), jnp.int32),
            )
            for n in (64 << i for i in range(7))
        ]

    @staticmethod
    def hf_weight_map(args: Qwen2VLArgs) -> dict[str, tuple[str, int | tuple[int, int] | None, bool]]:
        return LlamaForCausalLM.hf_weight_map(args) | vision_weight_map(args.vision)
