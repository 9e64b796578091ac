"""The Llama family (Llama 2/3, SmolLM2, Mistral) as a Flax NNX module. Qwen2/3, Phi-3,
Gemma 1/2/3, and the mixture-of-experts Mixtral and Qwen3-MoE are the same decoder with
switches (see LlamaArgs); each family's file says how its config sets them.

Windows and rope frequencies may differ from layer to layer (Gemma 2/3, Qwen): those ride
along the layer scan as per-layer inputs, so one compiled layer body still serves all.

The decoder layers are stored stacked ([num_layers, ...] per weight) and run with one
lax.scan, so compile time does not grow with depth. The KV pool of all layers is one
array carried through the scan and updated in place. Logits are computed only for the
rows the sampler needs.

The scan slices each layer's weights out of their stacks, except a 4-bit projection's, which
a native kernel takes whole with the layer's index (LayerWeights, pallas_kernels/quantized_matmul).
The price of the scan on XLA:CPU: a float32 or int8 layer's slice is copied out of the stack
before its dots (benchmarks/decode_profile.py shows it); per-layer arrays in an unrolled loop
avoid the copy but compiled ~5x slower (24 s against 5 s per bucket), so the scan stays.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import LoRAConfig
from jaxserve.layers.activation import ACTIVATIONS
from jaxserve.layers.attention import AttentionMetadata, paged_attention
from jaxserve.layers.linear import (
    LORA_TARGETS,
    SCALE_SUFFIX,
    LayerWeights,
    embed,
    embedding_params,
    kernel_params,
    linear,
    linears,
    lora_mask,
    lora_params,
    tied_head,
)
from jaxserve.layers.moe import MoEArgs, moe_mlp
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.pipeline import run_layers
from jaxserve.layers.rotary import apply_rope, rope_attention_scaling, rope_inv_freq
from jaxserve.models.causal_lm import CausalLM, InputEmbeds


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # biases on the q, k, v projections (Llama's attention_bias, Qwen2)
    o_bias: bool  # bias on the output projection (Llama's attention_bias only)
    mlp_bias: bool
    inv_freq: tuple[float, ...]
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rope (Qwen3, Gemma 3)
    # Keys each layer attends to at most (None: all). One window for every layer (Mistral),
    # or alternating windowed and full layers (Gemma 2/3, Qwen with use_sliding_window).
    layer_windows: tuple[int | None, ...] = ()
    rope_scaling: float = 1.0  # factor on cos/sin (YaRN's attention factor)
    # Gemma's switches; the defaults are Llama's.
    hidden_act: str = "silu"
    norm_offset: float = 0.0  # norms scale by (norm_offset + weight), in float32 (Gemma: 1)
    embed_scale: float | None = None  # embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    sandwich_norms: bool = False  # extra norms on the attention and MLP outputs (Gemma 2, 3)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_soft_cap: float | None = None  # scores -> cap * tanh(score / cap)
    final_soft_cap: float | None = None  # logits -> cap * tanh(logit / cap)
    local_inv_freq: tuple[float, ...] | None = None  # rope of the windowed layers, if their own (Gemma 3)
    moe: MoEArgs | None = None  # a mixture of experts in place of every layer's MLP (Mixtral, Qwen3-MoE)
    # Tensor parallelism over more devices than the checkpoint has KV heads: each KV head is
    # stored this many times (num_kv_heads counts the copies), so every device holds whole heads.
    kv_head_copies: int = 1
    # Weight-only quantization of the layers' projections (layers/linear.py): "int8", "fp8" or None;
    # a GGUF file's own formats per projection ("q_proj" -> "q8" or "q4") take precedence.
    quantization: str | None = None
    kernel_formats: tuple[tuple[str, str], ...] = ()
    # LoRA: the adapters' device slots (their count, rank, biases, sharding); None: no LoRA
    lora: LoRAConfig | None = None
    # M-RoPE (Qwen2-VL): per rotary frequency, which of a token's (time, height, width) positions
    # turns it (layers/rotary.py mrope_rows); () for one position per token
    mrope_rows: tuple[int, ...] = ()
    num_labels: int = 0  # a sequence classifier's classes: its score head's outputs (0: none)
    # the score head is a reward model's: a hidden layer (ReLU) before it, both with biases
    reward_hidden_layer: bool = False

    @classmethod
    def from_hf(cls, hf: Mapping, max_model_len: int) -> LlamaArgs:
        act = hf.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}.")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", False)),
            o_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            inv_freq=tuple(rope_inv_freq(hf, head_dim, max_model_len).tolist()),
            layer_windows=layer_windows(hf),
            rope_scaling=rope_attention_scaling(hf),
            hidden_act=act,
        )


# A window no context reaches: how a full-attention layer is written among windowed ones.
_NO_WINDOW = 2**30


def layer_windows(hf: Mapping) -> tuple[int | None, ...]:
    """Each layer's sliding window: `sliding_window` on the layers `layer_types` marks
    "sliding_attention", or on every layer when the config has no layer_types (Mistral)."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types") or ["sliding_attention"] * hf["num_hidden_layers"]
    if len(types) != hf["num_hidden_layers"]:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {hf['num_hidden_layers']}.")
    return tuple(int(window) if window and t == "sliding_attention" else None for t in types)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype, init: str = "normal"):
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


class LlamaLayers(nnx.Module):
    """All decoder layers, each weight stacked over a leading `layers` axis."""

    def __init__(self, a: LlamaArgs, dtype, rngs: nnx.Rngs):
        n, e, m = a.num_layers, a.hidden_size, a.intermediate_size
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim

        formats = dict(a.kernel_formats)
        adapted = {}  # the projections LoRA adapts: short name -> (shape, axes)

        def kernel(name: str, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> None:
            fmt = formats.get(name, a.quantization)
            for suffix, param in kernel_params(rngs, shape, axes, dtype, fmt).items():
                setattr(self, name + suffix, param)
            if a.lora and name in LORA_TARGETS:
                adapted[name.removesuffix("_proj")] = (shape, axes)

        self.input_norm = _param(rngs, (n, e), ("layers", "norm"), dtype, "ones")
        kernel("q_proj", (n, e, q), ("layers", "embed", "q_heads"))
        kernel("k_proj", (n, e, kv), ("layers", "embed", "kv_heads"))
        kernel("v_proj", (n, e, kv), ("layers", "embed", "kv_heads"))
        kernel("o_proj", (n, q, e), ("layers", "q_heads", "embed"))
        self.post_norm = _param(rngs, (n, e), ("layers", "norm"), dtype, "ones")
        if a.moe:
            x, m = a.moe.num_experts, a.moe.intermediate_size
            self.router = _param(rngs, (n, e, x), ("layers", "embed", None), dtype)
            kernel("expert_gate", (n, x, e, m), ("layers", "experts", "embed", "expert_mlp"))
            kernel("expert_up", (n, x, e, m), ("layers", "experts", "embed", "expert_mlp"))
            kernel("expert_down", (n, x, m, e), ("layers", "experts", "expert_mlp", "embed"))
        else:
            kernel("gate_proj", (n, e, m), ("layers", "embed", "mlp"))
            kernel("up_proj", (n, e, m), ("layers", "embed", "mlp"))
            kernel("down_proj", (n, m, e), ("layers", "mlp", "embed"))
        if a.qkv_bias:
            self.q_bias = _param(rngs, (n, q), ("layers", "q_heads"), dtype, "zeros")
            self.k_bias = _param(rngs, (n, kv), ("layers", "kv_heads"), dtype, "zeros")
            self.v_bias = _param(rngs, (n, kv), ("layers", "kv_heads"), dtype, "zeros")
        if a.o_bias:
            self.o_bias = _param(rngs, (n, e), ("layers", "embed"), dtype, "zeros")
        if a.sandwich_norms:
            self.attn_out_norm = _param(rngs, (n, e), ("layers", "norm"), dtype, "ones")
            self.mlp_out_norm = _param(rngs, (n, e), ("layers", "norm"), dtype, "ones")
        if a.qk_norm:
            self.q_norm = _param(rngs, (n, a.head_dim), ("layers", "norm"), dtype, "ones")
            self.k_norm = _param(rngs, (n, a.head_dim), ("layers", "norm"), dtype, "ones")
        if a.mlp_bias:
            self.gate_bias = _param(rngs, (n, m), ("layers", "mlp"), dtype, "zeros")
            self.up_bias = _param(rngs, (n, m), ("layers", "mlp"), dtype, "zeros")
            self.down_bias = _param(rngs, (n, e), ("layers", "embed"), dtype, "zeros")
        for key, param in (lora_params(adapted, a.lora) if a.lora else {}).items():
            setattr(self, key, param)

    def stacked(self) -> dict[str, jax.Array]:
        return {name: var.value for name, var in vars(self).items() if isinstance(var, nnx.Param)}


def _windows(layer_windows: tuple[int | None, ...]) -> tuple[int | None, np.ndarray | None]:
    """(the window all layers share, None) when they agree, else (None, each layer's window
    as an int32 array, full layers as _NO_WINDOW)."""
    if len(set(layer_windows)) <= 1:
        return (layer_windows[0] if layer_windows else None), None
    return None, np.asarray([w or _NO_WINDOW for w in layer_windows], np.int32)


class LlamaForCausalLM(CausalLM):
    def __init__(self, args: LlamaArgs, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.args = args
        self.dtype = jnp.dtype(dtype)  # the activations' (a quantized table's rows are cast to it)
        a = args
        embedding = embedding_params(
            rngs, a.vocab_size, a.hidden_size, dtype, dict(a.kernel_formats).get("embed_tokens")
        )
        for suffix, param in embedding.items():  # embed_tokens (and embed_tokens_scale, kept in Q8_0 groups)
            setattr(self, "embed_tokens" + suffix, param)
        self.layers = LlamaLayers(a, dtype, rngs)
        self.norm = _param(rngs, (a.hidden_size,), ("norm",), dtype, "ones")
        if not a.tie_word_embeddings:
            self.lm_head = _param(rngs, (a.hidden_size, a.vocab_size), ("embed", "vocab"), dtype)
        if a.num_labels:
            self.score = _param(rngs, (a.hidden_size, a.num_labels), ("embed", "labels"), dtype)
        if a.num_labels and a.reward_hidden_layer:
            self.score_hidden = _param(rngs, (a.hidden_size, a.hidden_size), ("embed", "labels"), dtype)
            self.score_hidden_bias = _param(rngs, (a.hidden_size,), ("labels",), dtype, "zeros")
            self.score_bias = _param(rngs, (a.num_labels,), ("labels",), dtype, "zeros")

    def hidden_states(
        self,
        input_ids: jax.Array,  # [num_tokens] int32
        positions: jax.Array,  # [num_tokens] int32
        kv_pool: jax.Array,  # [num_layers * pages_per_layer, 2 * num_kv_heads, page_size, head_dim]
        meta: AttentionMetadata,
        lora_slots: jax.Array | None = None,  # [num_tokens] int32, each token's LoRA slot (-1: none)
        input_embeds: InputEmbeds | None = None,  # rows fed in place of the embedding table's
        rope_positions: jax.Array | None = None,  # [3, num_tokens] int32: M-RoPE's positions
    ) -> tuple[jax.Array, jax.Array]:  # ([num_tokens, hidden], before the final norm; kv_pool)
        a = self.args
        pages_per_layer = kv_pool.shape[0] // a.num_layers
        lora = lora_mask(lora_slots, a.lora)
        sm_scale = a.attn_scale or a.head_dim**-0.5
        act = ACTIVATIONS[a.hidden_act]
        scale = getattr(self, "embed_tokens" + SCALE_SUFFIX, None)
        scale = None if scale is None else scale.value
        x = embed(self.embed_tokens.value, scale, input_ids, self.dtype)  # [num_tokens, hidden]
        if a.embed_scale is not None:
            x = x * jnp.asarray(a.embed_scale, x.dtype)
        if input_embeds is not None:
            x = input_embeds.over(x)

        def norm(x, weight):
            return rms_norm(x, weight, a.rms_norm_eps, a.norm_offset)

        # Per-layer inputs besides the weights: the window and rope frequencies where layers differ
        # in them (run_layers adds each layer's index: a kernel reads its stacks by it).
        sliced, whole = LayerWeights.split(self.layers.stacked())
        xs = {"weights": sliced}
        shared_window, windows = _windows(a.layer_windows)
        if windows is not None:
            xs["window"] = jnp.asarray(windows)
        inv_freq = jnp.asarray(np.asarray(a.inv_freq, np.float32))
        if a.local_inv_freq is not None:
            freqs = [a.local_inv_freq if w else a.inv_freq for w in a.layer_windows]
            xs["inv_freq"] = jnp.asarray(np.asarray(freqs, np.float32))

        def layer(carry, per_layer, whole, meta, shared):
            x, kv_pool = carry
            positions, lora = shared["positions"], shared["lora"]
            w = LayerWeights(per_layer["weights"], whole, per_layer["index"])
            layer_freq = per_layer.get("inv_freq", shared["inv_freq"])
            h = norm(x, w["input_norm"])
            q, k, v = linears(h, w, ("q", "k", "v"), lora)
            rows = x.shape[0]  # the step's tokens, or a pipeline microbatch of them
            q = q.reshape(rows, a.num_heads, a.head_dim)
            k = k.reshape(rows, a.num_kv_heads, a.head_dim)
            v = v.reshape(rows, a.num_kv_heads, a.head_dim)
            if a.qk_norm:
                q = norm(q, w["q_norm"])
                k = norm(k, w["k_norm"])
            q = apply_rope(q, positions, layer_freq, a.rope_scaling)
            k = apply_rope(k, positions, layer_freq, a.rope_scaling)
            attn, kv_pool = paged_attention(
                q,
                k,
                v,
                kv_pool,
                per_layer["index"],
                pages_per_layer,
                meta,
                sm_scale=sm_scale,
                sliding_window=per_layer.get("window", shared_window),
                soft_cap=a.attn_soft_cap,
            )
            out = linear(attn.reshape(rows, -1), w, "o", lora)
            x = x + (norm(out, w["attn_out_norm"]) if a.sandwich_norms else out)
            h = norm(x, w["post_norm"])
            if a.moe:
                names = ("expert_gate", "expert_up", "expert_down")
                scales = tuple(w[n + SCALE_SUFFIX] for n in names) if a.quantization else None
                out = moe_mlp(h, w["router"], *(w[n] for n in names), a.moe, scales)
            else:
                gate, up = linears(h, w, ("gate", "up"), lora)
                out = linear(act(gate) * up, w, "down", lora)
            x = x + (norm(out, w["mlp_out_norm"]) if a.sandwich_norms else out)
            return (x, kv_pool), None

        rotary = positions  # M-RoPE: each frequency turns by one of the token's three positions
        if a.mrope_rows and rope_positions is not None:  # (without them: text, all three alike)
            rotary = jnp.take(rope_positions, jnp.asarray(a.mrope_rows), axis=0).T
        shared = {"positions": rotary, "lora": lora, "inv_freq": inv_freq}
        return run_layers(layer, x, kv_pool, xs, whole, meta, shared, token_keys=("positions", "lora"))

    def final_hidden(self, x: jax.Array) -> jax.Array:
        a = self.args
        return rms_norm(x, self.norm.value, a.rms_norm_eps, a.norm_offset)

    def pooler_head(self, x: jax.Array) -> jax.Array:
        if not self.args.num_labels:
            return x
        if self.args.reward_hidden_layer:
            x = jnp.dot(x, self.score_hidden.value.astype(x.dtype), preferred_element_type=jnp.float32)
            x = jax.nn.relu(x + self.score_hidden_bias.value)
            out = jnp.dot(x, self.score.value.astype(x.dtype), preferred_element_type=jnp.float32)
            return out + self.score_bias.value
        return jnp.dot(x, self.score.value.astype(x.dtype), preferred_element_type=jnp.float32)

    def compute_logits(self, x: jax.Array) -> jax.Array:
        """[rows, vocab] float32 logits of hidden states [rows, hidden] (hidden_states' rows)."""
        a = self.args
        x = self.final_hidden(x)
        if a.tie_word_embeddings:
            scale = getattr(self, "embed_tokens" + SCALE_SUFFIX, None)
            logits = tied_head(x, self.embed_tokens.value, None if scale is None else scale.value)
        else:
            logits = jnp.dot(x, self.lm_head.value, preferred_element_type=jnp.float32)
        if a.final_soft_cap is not None:
            logits = a.final_soft_cap * jnp.tanh(logits / a.final_soft_cap)
        return logits

    @staticmethod
    def hf_weight_map(args: LlamaArgs) -> dict[str, tuple[str, int | tuple[int, int] | None, bool]]:
        """HF tensor name -> (our parameter path, index into its leading axes: layer,
        (layer, expert) or None, transpose?)."""
        table: dict[str, tuple[str, int | tuple[int, int] | None, bool]] = {
            "model.embed_tokens.weight": ("embed_tokens", None, False),
            "model.norm.weight": ("norm", None, False),
        }
        if not args.tie_word_embeddings:
            table["lm_head.weight"] = ("lm_head", None, True)
        if args.num_labels and args.reward_hidden_layer:  # nn.Sequential(Linear, ReLU, Linear)
            table["score.0.weight"] = ("score_hidden", None, True)
            table["score.0.bias"] = ("score_hidden_bias", None, False)
            table["score.2.weight"] = ("score", None, True)
            table["score.2.bias"] = ("score_bias", None, False)
        elif args.num_labels:
            table["score.weight"] = ("score", None, True)
        per_layer = {"input_layernorm.weight": ("input_norm", False)}
        if args.sandwich_norms:  # Gemma 2/3 name their norms after where they sit
            per_layer["post_attention_layernorm.weight"] = ("attn_out_norm", False)
            per_layer["pre_feedforward_layernorm.weight"] = ("post_norm", False)
            per_layer["post_feedforward_layernorm.weight"] = ("mlp_out_norm", False)
        else:
            per_layer["post_attention_layernorm.weight"] = ("post_norm", False)
        if not args.moe:
            per_layer |= {f"mlp.{p}_proj.weight": (f"{p}_proj", True) for p in ("gate", "up", "down")}
        for p in "qkvo":
            per_layer[f"self_attn.{p}_proj.weight"] = (f"{p}_proj", True)
            if args.o_bias if p == "o" else args.qkv_bias:
                per_layer[f"self_attn.{p}_proj.bias"] = (f"{p}_bias", False)
        if args.qk_norm:
            per_layer["self_attn.q_norm.weight"] = ("q_norm", False)
            per_layer["self_attn.k_norm.weight"] = ("k_norm", False)
        if args.mlp_bias:
            for p in ("gate", "up", "down"):
                per_layer[f"mlp.{p}_proj.bias"] = (f"{p}_bias", False)
        for i in range(args.num_layers):
            for hf_name, (ours, transpose) in per_layer.items():
                table[f"model.layers.{i}.{hf_name}"] = (f"layers.{ours}", i, transpose)
            if args.moe:  # Qwen3-MoE's names; other MoE families are renamed to them at load
                table[f"model.layers.{i}.mlp.gate.weight"] = ("layers.router", i, True)
                for j in range(args.moe.num_experts):
                    for p in ("gate", "up", "down"):
                        name = f"model.layers.{i}.mlp.experts.{j}.{p}_proj.weight"
                        table[name] = (f"layers.expert_{p}", (i, j), True)
        return table
