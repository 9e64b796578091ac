"""ModernBERT (answerdotai/ModernBERT-*, gte-modernbert) as a Flax NNX encoder, served for pooling.

A pre-norm encoder: token embeddings and a LayerNorm (no position table: rotary embeddings),
then layers of attention (a fused q/k/v projection, no biases) and a gated GELU MLP (the fused
input projection split into value and gate), each behind a LayerNorm (the first layer's
attention behind none), and a final LayerNorm. Every `global_attn_every_n_layers`-th layer
attends to its whole sequence with the global rope base; the others see the tokens within
local_attention / 2 of their own position with the local base. As the BERT port, every token of
a prompt is in one step (layers/attention.py sequence_attention) and no KV is kept; the layers
are stacked and run with one lax.scan, the layer kind a traced choice. Weights are replicated
under tensor parallelism (ModernBERT models are small); quantized projections and LoRA are not
supported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import LoRAConfig
from jaxserve.layers.activation import ACTIVATIONS
from jaxserve.layers.attention import AttentionMetadata, sequence_attention
from jaxserve.layers.linear import on_device
from jaxserve.layers.pipeline import run_layers
from jaxserve.layers.rotary import apply_rope, rope_inv_freq
from jaxserve.models.causal_lm import CausalLM
from jaxserve.models.llama import _param
from jaxserve.models.opt import layer_norm


@dataclass(frozen=True)
class ModernBertArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    norm_eps: float
    norm_bias: bool
    activation: str
    global_every: int  # layer i attends globally when i % global_every == 0
    window: int  # a local layer's tokens see those within this distance of their position
    global_inv_freq: tuple[float, ...]
    local_inv_freq: tuple[float, ...]
    # what the engine's checks read of every family's args
    tie_word_embeddings: bool = True  # no LM head
    bidirectional: bool = True
    num_labels: int = 0
    quantization: str | None = None
    lora: LoRAConfig | None = None

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    def __post_init__(self):
        if self.quantization or self.lora or self.num_labels:
            raise ValueError("ModernBERT is served as an embedding model in float weights (no quantization, "
                             "LoRA or classifier head).")  # fmt: skip
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"hidden_activation {self.activation!r} is not supported for ModernBERT.")

    @classmethod
    def from_hf(cls, hf: Mapping, max_model_len: int) -> ModernBertArgs:
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise ValueError(f"ModernBERT models with {key}=true are not supported by jaxserve.")
        heads = hf["num_attention_heads"]
        head_dim = hf["hidden_size"] // heads
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            head_dim=head_dim,
            norm_eps=hf.get("norm_eps", 1e-5),
            norm_bias=bool(hf.get("norm_bias", False)),
            activation=hf.get("hidden_activation", "gelu"),
            global_every=hf.get("global_attn_every_n_layers", 3),
            window=hf.get("local_attention", 128) // 2,
            global_inv_freq=tuple(
                rope_inv_freq(_rope(hf, "full_attention"), head_dim, max_model_len).tolist()
            ),
            local_inv_freq=tuple(
                rope_inv_freq(_rope(hf, "sliding_attention"), head_dim, max_model_len).tolist()
            ),
        )


def _rope(hf: Mapping, layer_type: str) -> dict:
    """One layer type's rope settings, in either config spelling (transformers 5 nests them; older
    configs give global_rope_theta and local_rope_theta)."""
    if hf.get("rope_parameters"):
        return {"rope_parameters": hf["rope_parameters"][layer_type]}
    theta = (
        hf.get("global_rope_theta", 160000.0)
        if layer_type == "full_attention"
        else hf.get("local_rope_theta", 10000.0)
    )
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}


class ModernBertModel(CausalLM):
    def __init__(self, args: ModernBertArgs, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.args = a = args
        e = a.hidden_size
        self.embed_tokens = _param(rngs, (a.vocab_size, e), ("vocab", "embed"), dtype)
        self.layers = ModernBertLayers(a, dtype, rngs)
        for name in ("embed_norm", "final_norm"):
            setattr(self, name, _param(rngs, (e,), ("norm",), dtype, "ones"))
            if a.norm_bias:
                setattr(self, f"{name}_bias", _param(rngs, (e,), ("norm",), dtype, "zeros"))

    def _norm(self, x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
        return layer_norm(x, w, jnp.zeros_like(w) if b is None else b, self.args.norm_eps)

    def hidden_states(
        self,
        input_ids: jax.Array,  # [num_tokens] int32
        positions: jax.Array,  # [num_tokens] int32
        kv_pool: jax.Array,  # untouched: an encoder keeps no KV
        meta: AttentionMetadata,
        lora_slots: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        a = self.args
        n = input_ids.shape[0]
        bias = getattr(self, "embed_norm_bias", None)
        x = self._norm(
            self.embed_tokens.value[input_ids], self.embed_norm.value, None if bias is None else bias.value
        )
        act = ACTIVATIONS[a.activation]
        inv_freq = jnp.asarray([a.local_inv_freq, a.global_inv_freq], jnp.float32)

        def layer(carry, per_layer, whole, meta, shared):
            x, _ = carry
            positions, inv_freq = shared
            w, index = on_device(per_layer["weights"]), per_layer["number"]  # (the model's, not the stage's)
            is_global = (index % a.global_every == 0).astype(jnp.int32)
            h = jnp.where(index == 0, x, self._norm(x, w["attn_norm"], w.get("attn_norm_bias")))
            q, k, v = jnp.split((h @ w["qkv_proj"]).reshape(n, 3 * a.num_heads, a.head_dim), 3, axis=1)
            q, k = (apply_rope(t, positions, inv_freq[is_global]) for t in (q, k))
            window = jnp.where(is_global == 1, jnp.iinfo(jnp.int32).max, a.window)
            attn = sequence_attention(q, k, v, meta.cu_q_lens, a.head_dim**-0.5, positions, window)
            x = x + attn.reshape(n, -1) @ w["o_proj"]
            value, gate = jnp.split(
                self._norm(x, w["mlp_norm"], w.get("mlp_norm_bias")) @ w["wi_proj"], 2, axis=-1
            )
            return (x + (act(value) * gate) @ w["wo_proj"], None), None

        xs = {"weights": self.layers.stacked(), "number": jnp.arange(a.num_layers, dtype=jnp.int32)}
        return run_layers(layer, x, None, xs, meta=meta, shared=(positions, inv_freq))[0], kv_pool

    def final_hidden(self, x: jax.Array) -> jax.Array:
        bias = getattr(self, "final_norm_bias", None)
        return self._norm(x, self.final_norm.value, None if bias is None else bias.value)

    @staticmethod
    def hf_weight_map(args: ModernBertArgs) -> dict[str, tuple[str, int | None, bool]]:
        """HF tensor name -> (our parameter path, layer index or None, transpose?)."""
        table: dict[str, tuple[str, int | None, bool]] = {
            "embeddings.tok_embeddings.weight": ("embed_tokens", None, False),
            "embeddings.norm.weight": ("embed_norm", None, False),
            "final_norm.weight": ("final_norm", None, False),
        }
        if args.norm_bias:
            table["embeddings.norm.bias"] = ("embed_norm_bias", None, False)
            table["final_norm.bias"] = ("final_norm_bias", None, False)
        per_layer = {"attn.Wqkv.weight": ("qkv_proj", True), "attn.Wo.weight": ("o_proj", True),
                     "mlp.Wi.weight": ("wi_proj", True), "mlp.Wo.weight": ("wo_proj", True),
                     "mlp_norm.weight": ("mlp_norm", False)}  # fmt: skip
        if args.norm_bias:
            per_layer["mlp_norm.bias"] = ("mlp_norm_bias", False)
        for i in range(args.num_layers):
            names = dict(per_layer)
            if i:  # the first layer's attention has no norm before it
                names["attn_norm.weight"] = ("attn_norm", False)
                if args.norm_bias:
                    names["attn_norm.bias"] = ("attn_norm_bias", False)
            for hf_name, (ours, transpose) in names.items():
                table[f"layers.{i}.{hf_name}"] = (f"layers.{ours}", i, transpose)
        return table


class ModernBertLayers(nnx.Module):
    """All layers, each weight stacked over a leading `layers` axis (replicated)."""

    def __init__(self, a: ModernBertArgs, dtype, rngs: nnx.Rngs):
        n, e, m = a.num_layers, a.hidden_size, a.intermediate_size
        shapes = {"qkv_proj": (e, 3 * e), "o_proj": (e, e), "wi_proj": (e, 2 * m), "wo_proj": (m, e)}
        for name, shape in shapes.items():
            setattr(self, name, _param(rngs, (n, *shape), ("layers", "embed", None), dtype))
        for norm in ("attn_norm", "mlp_norm"):
            setattr(self, norm, _param(rngs, (n, e), ("layers", "norm"), dtype, "ones"))
            if a.norm_bias:
                setattr(self, f"{norm}_bias", _param(rngs, (n, e), ("layers", "norm"), dtype, "zeros"))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: var.value for name, var in vars(self).items() if isinstance(var, nnx.Param)}
