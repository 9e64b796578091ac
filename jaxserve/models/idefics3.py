"""Idefics3 / SmolVLM: a SigLIP vision encoder, a pixel shuffle and one projection into the text
embedding space, then the Llama decoder (SmolVLM-256M's is SmolLM2-135M). The decoder is
LlamaForCausalLM unchanged; `image_features` turns an image's tiles into the rows that replace its
`<image>` tokens' embeddings, which the step feeds like prompt embeddings (models/causal_lm.py
InputEmbeds).

Every tile the processor makes is max_image_size square (jaxserve/multimodal/idefics3_processor.py),
so a tile's patches are all real: transformers' patch mask is all ones and its bucketed position
ids are a fixed table, computed here once with its float32 arithmetic. Tiles are encoded one at a
time (lax.map): a tile's attention is dense over its patches ([heads, 1024, 1024] for SmolVLM).
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
from jaxserve.layers.vit import add_block_params, block, param, stacked_params
from jaxserve.models.llama import LlamaArgs, LlamaForCausalLM
from jaxserve.models.opt import layer_norm


@dataclass(frozen=True)
class VisionArgs:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # the side the position table was trained for
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    scale_factor: int  # the pixel shuffle's: scale_factor**2 patches become one token
    image_token_id: int
    # heads and MLP split over the model axis (tensor parallel, when both divide); else whole
    tp_split: bool = False

    @classmethod
    def from_hf(cls, hf: Mapping) -> VisionArgs:
        v = hf["vision_config"]
        return cls(
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_layers=v["num_hidden_layers"],
            num_heads=v["num_attention_heads"],
            image_size=v["image_size"],
            patch_size=v["patch_size"],
            num_channels=v.get("num_channels", 3),
            layer_norm_eps=v.get("layer_norm_eps", 1e-6),
            hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
            scale_factor=hf.get("scale_factor", 2),
            image_token_id=hf["image_token_id"],
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """The `<image>` tokens one tile fills (transformers' image_seq_len)."""
        return self.patches_per_side**2 // self.scale_factor**2


@dataclass(frozen=True)
class Idefics3Args(LlamaArgs):
    vision: VisionArgs | None = None


def idefics3_args(hf: Mapping, max_model_len: int) -> Idefics3Args:
    """The decoder's args from the config's text part (model_resolution flattens it into the
    top level), the encoder's from vision_config."""
    text = LlamaArgs.from_hf(hf, max_model_len)
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text)}
    return Idefics3Args(**fields, vision=VisionArgs.from_hf(hf))


def idefics3_names(name: str, tensor: np.ndarray, args: Idefics3Args) -> Iterator[tuple[str, np.ndarray]]:
    """The decoder's tensors under Llama's names; the patch convolution as the matmul it is
    ([out, channels * patch * patch])."""
    if name.startswith("model.text_model."):
        name = "model." + name.removeprefix("model.text_model.")
    elif name == "model.vision_model.embeddings.patch_embedding.weight":
        tensor = np.asarray(tensor).reshape(tensor.shape[0], -1)
    yield name, tensor


def position_ids(v: VisionArgs, patches_per_side: int) -> np.ndarray:
    """[patches] int32: transformers' position ids of a tile whose patches are all real, with its
    float32 fractions bucketed against float32 boundaries."""
    boundaries = np.arange(1 / v.patches_per_side, 1.0, 1 / v.patches_per_side).astype(np.float32)
    step = np.float32(1.0) / np.float32(patches_per_side)
    coords = np.minimum(np.arange(patches_per_side, dtype=np.float32) * step, np.float32(1.0 - 1e-6))
    buckets = np.searchsorted(boundaries, coords, side="right")
    return (buckets[:, None] * v.patches_per_side + buckets[None, :]).reshape(-1).astype(np.int32)


class VisionTower(nnx.Module):
    """The SigLIP encoder (layers stacked, run by one scan) and the connector's projection. Under
    tensor parallelism each device holds its share of the heads and of the MLP (when they split
    evenly; else the whole encoder), and XLA partitions the encoder as the weights are split."""

    def __init__(self, v: VisionArgs, text_hidden: int, dtype, rngs: nnx.Rngs):
        d = v.hidden_size
        self.patch_kernel = param(rngs, (v.num_channels * v.patch_size**2, d), dtype)
        self.patch_bias = param(rngs, (d,), dtype, "zeros")
        self.positions = param(rngs, (v.patches_per_side**2, d), dtype)
        shape = (v.num_layers, d, v.intermediate_size)
        self._block_names = add_block_params(self, rngs, shape, dtype, v.tp_split)
        self.post_ln_weight = param(rngs, (d,), dtype, "ones")
        self.post_ln_bias = param(rngs, (d,), dtype, "zeros")
        self.projection = param(rngs, (d * v.scale_factor**2, text_hidden), dtype)

    def stacked(self) -> dict[str, jax.Array]:
        return stacked_params(self, self._block_names)


def encode_tile(tower: VisionTower, v: VisionArgs, pixels: jax.Array) -> jax.Array:
    """[channels, side, side] -> [tokens_per_tile, text hidden]: patches, the encoder, the
    pixel shuffle and the projection, as transformers' get_image_features for one tile."""
    p, side = v.patch_size, pixels.shape[-1] // v.patch_size
    dtype = tower.patch_kernel.value.dtype
    patches = pixels.reshape(v.num_channels, side, p, side, p).transpose(1, 3, 0, 2, 4)
    x = patches.reshape(side * side, -1).astype(dtype) @ tower.patch_kernel.value + tower.patch_bias.value
    x = x + tower.positions.value[jnp.asarray(position_ids(v, side))]
    act = ACTIVATIONS[v.hidden_act]

    def norm(x, w, name):
        return layer_norm(x, w[name + "_weight"], w[name + "_bias"], v.layer_norm_eps)

    def layer(x, w):
        return block(x, w, v.num_heads, act, norm), None

    x, _ = jax.lax.scan(layer, x, tower.stacked())
    x = layer_norm(x, tower.post_ln_weight.value, tower.post_ln_bias.value, v.layer_norm_eps)
    s, d = v.scale_factor, v.hidden_size  # the pixel shuffle: s x s neighbours into one row
    x = x.reshape(side, side // s, d * s).transpose(1, 0, 2).reshape(side // s, side // s, d * s * s)
    x = x.transpose(1, 0, 2).reshape(-1, d * s * s)
    return jnp.dot(x, tower.projection.value, preferred_element_type=jnp.float32)


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, args: Idefics3Args, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(args, dtype=dtype, rngs=rngs)
        self.vision = VisionTower(args.vision, args.hidden_size, dtype, rngs)

    def image_features(self, pixel_values: jax.Array) -> jax.Array:
        """[tiles, channels, side, side] -> [tiles * tokens_per_tile, hidden] float32."""
        rows = jax.lax.map(lambda t: encode_tile(self.vision, self.args.vision, t), pixel_values)
        return rows.reshape(-1, rows.shape[-1])

    def image_call(self, tile: jax.Array) -> jax.Array:
        """The encoder's unit of work (runner/image_encoder.py): one tile [channels, side, side]
        -> its [tokens_per_tile, hidden] rows."""
        return encode_tile(self.vision, self.args.vision, tile)

    @staticmethod
    def image_call_shapes(args: Idefics3Args) -> list[tuple[jax.ShapeDtypeStruct, ...]]:
        """The calls start-up compiles: a tile of the side the encoder was trained for."""
        v = args.vision
        return [(jax.ShapeDtypeStruct((v.num_channels, v.image_size, v.image_size), jnp.float32),)]

    @staticmethod
    def hf_weight_map(args: Idefics3Args) -> dict[str, tuple[str, int | tuple[int, int] | None, bool]]:
        table = LlamaForCausalLM.hf_weight_map(args)
        vm = "model.vision_model."
        table |= {
            vm + "embeddings.patch_embedding.weight": ("vision.patch_kernel", None, True),
            vm + "embeddings.patch_embedding.bias": ("vision.patch_bias", None, False),
            vm + "embeddings.position_embedding.weight": ("vision.positions", None, False),
            vm + "post_layernorm.weight": ("vision.post_ln_weight", None, False),
            vm + "post_layernorm.bias": ("vision.post_ln_bias", None, False),
            "model.connector.modality_projection.proj.weight": ("vision.projection", None, True),
        }
        per_layer = {f"self_attn.{p}_proj": p for p in "qkv"} | {"self_attn.out_proj": "o"}
        per_layer |= {"mlp.fc1": "fc1", "mlp.fc2": "fc2"}
        for i in range(args.vision.num_layers):
            prefix = f"{vm}encoder.layers.{i}."
            for hf, ours in per_layer.items():
                table[prefix + hf + ".weight"] = (f"vision.{ours}_kernel", i, True)
                table[prefix + hf + ".bias"] = (f"vision.{ours}_bias", i, False)
            for n in ("1", "2"):
                table[f"{prefix}layer_norm{n}.weight"] = (f"vision.ln{n}_weight", i, False)
                table[f"{prefix}layer_norm{n}.bias"] = (f"vision.ln{n}_bias", i, False)
        return table
