"""OPT (facebook/opt-*) as a Flax NNX module; GPT-2 is the same decoder (see gpt2.py).

The decoder: token embeddings (optionally of a smaller width, `word_embed_proj_dim`, with
`project_in` / `project_out` around the layers), learned absolute position embeddings
(OPT's table is indexed by position + 2), then layers of multi-head attention and a
two-matrix MLP (ReLU in OPT) with LayerNorms, and the LM head tied to the token
embeddings. The LayerNorms come before each block (pre-LN, OPT's `do_layer_norm_before`)
or after each residual sum (post-LN, opt-350m); pre-LN models end with one more LayerNorm.

As in the Llama port, the layers are stacked ([num_layers, ...] per weight) and run with
one lax.scan that carries the paged KV pool, and logits are computed only for the rows the
sampler needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import LoRAConfig
from jaxserve.layers.activation import ACTIVATIONS
from jaxserve.layers.attention import AttentionMetadata, paged_attention, sequence_attention
from jaxserve.layers.linear import kernel_params, linear, linears, lora_mask, lora_params, on_device
from jaxserve.layers.pipeline import run_layers
from jaxserve.models.causal_lm import CausalLM, InputEmbeds
from jaxserve.models.llama import _param


@dataclass(frozen=True)
class OPTArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # == num_heads (multi-head attention); read by the KV pool sizing
    head_dim: int
    word_embed_proj_dim: int  # width of the token embeddings and the LM head
    num_positions: int  # rows of the position table
    position_offset: int  # the table row of position p is p + position_offset (2 in OPT)
    pre_norm: bool  # LayerNorm before each block (else after each residual sum)
    final_norm: bool  # one LayerNorm after the last layer
    norm_affine: bool  # LayerNorms with weight and bias
    layer_norm_eps: float
    bias: bool  # biases on the attention and MLP projections
    activation: str
    tie_word_embeddings: bool
    quantization: str | None = None  # of the layers' projections (layers/linear.py)
    lora: LoRAConfig | None = None  # LoRA adapters' device slots on every projection; None: no LoRA
    # An encoder (BERT, RoBERTa: models/bert.py): each token attends to every token of its
    # sequence in the step (a whole prompt, never chunked), and no KV is kept; the embeddings get
    # token types (derived from the separator: a token after a sequence's first sep_token_id is of
    # type 1, BERT's pair layout) and a LayerNorm.
    bidirectional: bool = False
    embed_norm: bool = False
    type_vocab_size: int = 0
    sep_token_id: int | None = None
    # A sequence classifier's classes (BERT's and RoBERTa's heads: tanh(dense(x)), then a
    # projection with bias, over [CLS]); 0: none
    num_labels: int = 0

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation_function {self.activation!r} is not supported for OPT/GPT-2 models "
                f"(supported: {', '.join(sorted(ACTIVATIONS))})."
            )
        if self.head_dim * self.num_heads != self.hidden_size:
            raise ValueError(
                f"hidden size {self.hidden_size} is not a multiple of the {self.num_heads} attention heads."
            )

    def check_len(self, max_model_len: int) -> OPTArgs:
        if max_model_len + self.position_offset > self.num_positions:
            raise ValueError(
                f"max_model_len={max_model_len} is longer than the model's "
                f"{self.num_positions - self.position_offset} learned positions; pass a smaller max_model_len."
            )
        return self

    @classmethod
    def from_hf(cls, hf: Mapping, max_model_len: int) -> OPTArgs:
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        pre_norm = bool(hf.get("do_layer_norm_before", True))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["ffn_dim"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            word_embed_proj_dim=hf.get("word_embed_proj_dim") or hidden,
            num_positions=hf["max_position_embeddings"] + 2,
            position_offset=2,
            pre_norm=pre_norm,
            final_norm=pre_norm and not hf.get("_remove_final_layer_norm", False),
            norm_affine=bool(hf.get("layer_norm_elementwise_affine", True)),
            layer_norm_eps=1e-5,  # torch.nn.LayerNorm's default; OPT configs do not set it
            bias=bool(hf.get("enable_bias", True)),
            activation=hf.get("activation_function", "relu"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        ).check_len(max_model_len)


def opt_names(name: str, tensor: np.ndarray, args: OPTArgs) -> Iterator[tuple[str, np.ndarray]]:
    """Hub OPT checkpoints name their tensors `decoder.*` or `model.decoder.*`: one form."""
    yield ("model." + name if name.startswith("decoder.") else name), tensor


def layer_norm(x: jax.Array, weight: jax.Array | None, bias: jax.Array | None, eps: float) -> jax.Array:
    """LayerNorm over the last axis, computed in float32 and rounded once, as torch does."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


class OPTLayers(nnx.Module):
    """All decoder layers, each weight stacked over a leading `layers` axis."""

    def __init__(self, a: OPTArgs, dtype, rngs: nnx.Rngs):
        n, e, m = a.num_layers, a.hidden_size, a.intermediate_size
        for norm in ("attn_norm", "mlp_norm"):
            if a.norm_affine:
                setattr(self, norm, _param(rngs, (n, e), ("layers", "norm"), dtype, "ones"))
                setattr(self, f"{norm}_bias", _param(rngs, (n, e), ("layers", "norm"), dtype, "zeros"))
        shapes = {
            "q": ((e, e), ("embed", "q_heads"), ("q_heads",)),
            "k": ((e, e), ("embed", "kv_heads"), ("kv_heads",)),
            "v": ((e, e), ("embed", "kv_heads"), ("kv_heads",)),
            "o": ((e, e), ("q_heads", "embed"), ("embed",)),
            "fc1": ((e, m), ("embed", "mlp"), ("mlp",)),
            "fc2": ((m, e), ("mlp", "embed"), ("embed",)),
        }
        for name, (shape, axes, bias_axes) in shapes.items():
            for suffix, param in kernel_params(
                rngs, (n, *shape), ("layers", *axes), dtype, a.quantization
            ).items():
                setattr(self, f"{name}_proj{suffix}", param)
            if a.bias:
                bias = _param(rngs, (n, shape[1]), ("layers", *bias_axes), dtype, "zeros")
                setattr(self, f"{name}_bias", bias)
        if a.lora:  # every projection adapted
            adapted = {name: ((n, *shape), ("layers", *axes)) for name, (shape, axes, _) in shapes.items()}
            for key, param in lora_params(adapted, a.lora).items():
                setattr(self, key, param)

    def stacked(self) -> dict[str, jax.Array]:
        return {name: var.value for name, var in vars(self).items() if isinstance(var, nnx.Param)}


class OPTForCausalLM(CausalLM):
    def __init__(self, args: OPTArgs, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.args = a = args
        e, d = a.hidden_size, a.word_embed_proj_dim
        self.embed_tokens = _param(rngs, (a.vocab_size, d), ("vocab", "embed"), dtype)
        # the position axis has no logical name: replicated
        self.embed_positions = _param(rngs, (a.num_positions, e), (None, "embed"), dtype)
        if d != e:
            self.project_in = _param(rngs, (d, e), ("embed", "embed"), dtype)
            self.project_out = _param(rngs, (e, d), ("embed", "embed"), dtype)
        self.layers = OPTLayers(a, dtype, rngs)
        if a.final_norm and a.norm_affine:
            self.final_norm = _param(rngs, (e,), ("norm",), dtype, "ones")
            self.final_norm_bias = _param(rngs, (e,), ("norm",), dtype, "zeros")
        if a.type_vocab_size:
            self.embed_types = _param(rngs, (a.type_vocab_size, e), (None, "embed"), dtype)
        if a.embed_norm:
            self.embed_norm = _param(rngs, (e,), ("norm",), dtype, "ones")
            self.embed_norm_bias = _param(rngs, (e,), ("norm",), dtype, "zeros")
        if a.num_labels:
            self.cls_dense = _param(rngs, (e, e), ("embed", None), dtype)
            self.cls_dense_bias = _param(rngs, (e,), ("norm",), dtype, "zeros")
            self.cls_out = _param(rngs, (e, a.num_labels), ("embed", "labels"), dtype)
            self.cls_out_bias = _param(rngs, (a.num_labels,), ("labels",), dtype, "zeros")
        if not a.tie_word_embeddings:
            self.lm_head = _param(rngs, (d, a.vocab_size), ("embed", "vocab"), dtype)

    def hidden_states(
        self,
        input_ids: jax.Array,  # [num_tokens] int32
        positions: jax.Array,  # [num_tokens] int32
        kv_pool: jax.Array,  # [num_layers * pages_per_layer, 2 * num_kv_heads, page_size, head_dim]
        meta: AttentionMetadata,
        lora_slots: jax.Array | None = None,  # [num_tokens] int32, each token's LoRA slot (-1: none)
        input_embeds: InputEmbeds | None = None,  # rows fed in place of the embedding table's
    ) -> tuple[jax.Array, jax.Array]:  # ([num_tokens, hidden], before the final norm; kv_pool)
        a = self.args
        pages_per_layer = kv_pool.shape[0] // a.num_layers
        lora = lora_mask(lora_slots, a.lora)
        act = ACTIVATIONS[a.activation]
        x = self.embed_tokens.value[input_ids]
        if input_embeds is not None:
            x = input_embeds.over(x)
        if a.word_embed_proj_dim != a.hidden_size:
            x = x @ self.project_in.value
        x = x + self.embed_positions.value[positions + a.position_offset]
        if a.type_vocab_size:
            x = x + self.embed_types.value[self._token_types(input_ids, meta.cu_q_lens)]
        if a.embed_norm:
            x = layer_norm(x, self.embed_norm.value, self.embed_norm_bias.value, a.layer_norm_eps)

        def norm(x, w, name):
            return layer_norm(x, w.get(name), w.get(f"{name}_bias"), a.layer_norm_eps)

        def layer(carry, per_layer, whole, meta, shared):
            x, kv_pool = carry
            lora, rows = shared["lora"], x.shape[0]  # (rows: the step's tokens, or a microbatch's)
            w, index = on_device(per_layer["weights"]), per_layer["index"]
            h = norm(x, w, "attn_norm") if a.pre_norm else x
            q, k, v = linears(h, w, ("q", "k", "v"), lora)
            q = q.reshape(rows, a.num_heads, a.head_dim)
            k = k.reshape(rows, a.num_kv_heads, a.head_dim)
            v = v.reshape(rows, a.num_kv_heads, a.head_dim)
            if a.bidirectional:
                attn = sequence_attention(q, k, v, meta.cu_q_lens, a.head_dim**-0.5)
            else:
                attn, kv_pool = paged_attention(
                    q, k, v, kv_pool, index, pages_per_layer, meta, sm_scale=a.head_dim**-0.5
                )
            x = x + linear(attn.reshape(rows, -1), w, "o", lora)
            if not a.pre_norm:
                x = norm(x, w, "attn_norm")
            h = norm(x, w, "mlp_norm") if a.pre_norm else x
            x = x + linear(act(linear(h, w, "fc1", lora)), w, "fc2", lora)
            if not a.pre_norm:
                x = norm(x, w, "mlp_norm")
            return (x, kv_pool), None

        weights = {"weights": self.layers.stacked()}
        # an encoder's attention sees whole sequences: its steps are never cut into microbatches
        tokens = None if a.bidirectional else ("lora",)
        return run_layers(layer, x, kv_pool, weights, meta=meta, shared={"lora": lora}, token_keys=tokens)

    def _token_types(self, input_ids: jax.Array, cu: jax.Array) -> jax.Array:
        """[num_tokens] int32: 0, or 1 for a token after its sequence's first separator (with two
        types; one type: all 0)."""
        a = self.args
        if a.type_vocab_size < 2 or a.sep_token_id is None:
            return jnp.zeros_like(input_ids)
        is_sep = (input_ids == a.sep_token_id).astype(jnp.int32)
        seps_before = jnp.cumsum(is_sep) - is_sep  # from the batch's first token
        n = input_ids.shape[0]
        row = jnp.searchsorted(cu, jnp.arange(n), side="right") - 1
        start = jnp.minimum(cu[jnp.minimum(row, cu.shape[0] - 1)], n - 1)  # the row's first token
        return jnp.minimum(seps_before - seps_before[start], 1)

    def pooler_head(self, x: jax.Array) -> jax.Array:
        """A classifier's head over pooled rows (not linear: it reads whole [CLS] rows, which an
        encoder's steps always hold); nothing for an embedding model."""
        if not self.args.num_labels:
            return x
        h = jnp.tanh(x @ self.cls_dense.value.astype(x.dtype) + self.cls_dense_bias.value.astype(x.dtype))
        return h @ self.cls_out.value.astype(x.dtype) + self.cls_out_bias.value.astype(x.dtype)

    def final_hidden(self, x: jax.Array) -> jax.Array:
        a = self.args
        if a.final_norm:
            affine = a.norm_affine
            weight, bias = (self.final_norm.value, self.final_norm_bias.value) if affine else (None, None)
            x = layer_norm(x, weight, bias, a.layer_norm_eps)
        if a.word_embed_proj_dim != a.hidden_size:
            x = x @ self.project_out.value
        return x

    def compute_logits(self, x: jax.Array) -> jax.Array:
        """[rows, vocab] float32 logits of hidden states [rows, hidden] (hidden_states' rows)."""
        a = self.args
        x = self.final_hidden(x)
        head = self.embed_tokens.value.T if a.tie_word_embeddings else self.lm_head.value
        return jnp.dot(x, head, preferred_element_type=jnp.float32)

    @staticmethod
    def hf_weight_map(args: OPTArgs) -> dict[str, tuple[str, int | None, bool]]:
        """HF tensor name -> (our parameter path, layer index or None, transpose?)."""
        a = args
        table: dict[str, tuple[str, int | None, bool]] = {
            "model.decoder.embed_tokens.weight": ("embed_tokens", None, False),
            "model.decoder.embed_positions.weight": ("embed_positions", None, False),
        }
        if a.word_embed_proj_dim != a.hidden_size:
            table["model.decoder.project_in.weight"] = ("project_in", None, True)
            table["model.decoder.project_out.weight"] = ("project_out", None, True)
        if a.type_vocab_size:
            table["model.decoder.embed_types.weight"] = ("embed_types", None, False)
        if a.embed_norm:
            table["model.decoder.embed_norm.weight"] = ("embed_norm", None, False)
            table["model.decoder.embed_norm.bias"] = ("embed_norm_bias", None, False)
        if a.num_labels:
            for head in ("cls_dense", "cls_out"):
                table[f"model.decoder.{head}.weight"] = (head, None, True)
                table[f"model.decoder.{head}.bias"] = (f"{head}_bias", None, False)
        if a.final_norm and a.norm_affine:
            table["model.decoder.final_layer_norm.weight"] = ("final_norm", None, False)
            table["model.decoder.final_layer_norm.bias"] = ("final_norm_bias", None, False)
        if not a.tie_word_embeddings:
            table["lm_head.weight"] = ("lm_head", None, True)
        per_layer: dict[str, tuple[str, bool]] = {}
        if a.norm_affine:
            for hf_norm, ours in (("self_attn_layer_norm", "attn_norm"), ("final_layer_norm", "mlp_norm")):
                per_layer[f"{hf_norm}.weight"] = (ours, False)
                per_layer[f"{hf_norm}.bias"] = (f"{ours}_bias", False)
        projections = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v"}
        projections |= {"self_attn.out_proj": "o", "fc1": "fc1", "fc2": "fc2"}
        for hf_proj, ours in projections.items():
            per_layer[f"{hf_proj}.weight"] = (f"{ours}_proj", True)
            if a.bias:
                per_layer[f"{hf_proj}.bias"] = (f"{ours}_bias", False)
        for i in range(a.num_layers):
            for hf_name, (ours, transpose) in per_layer.items():
                table[f"model.decoder.layers.{i}.{hf_name}"] = (f"layers.{ours}", i, transpose)
        return table
