"""GPT-2: the OPT pre-LN decoder with position table offset 0, gelu_new (tanh-approximate
GELU) and LayerNorm eps from the config. The port is OPTForCausalLM; this file maps the
config and renames the checkpoint's tensors into OPT's names at load: `attn.c_attn` holds q,
k and v side by side, and GPT-2's Conv1D weights are stored [in, out] (transposed here into
the [out, in] of the nn.Linear weights the OPT map expects). Names may carry a
`transformer.` prefix or not (the hub's gpt2 has none)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import numpy as np

from jaxserve.models.opt import OPTArgs

# Config switches whose attention the port does not implement, and the value that is.
_REFUSED = {
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
    "scale_attn_weights": True,
}

# GPT-2 name (after `transformer.`) -> OPT name; \1 is the layer index.
_RENAMES = [
    (r"wte\.weight", "model.decoder.embed_tokens.weight"),
    (r"wpe\.weight", "model.decoder.embed_positions.weight"),
    (r"ln_f\.(weight|bias)", r"model.decoder.final_layer_norm.\1"),
    (r"h\.(\d+)\.ln_1\.(weight|bias)", r"model.decoder.layers.\1.self_attn_layer_norm.\2"),
    (r"h\.(\d+)\.ln_2\.(weight|bias)", r"model.decoder.layers.\1.final_layer_norm.\2"),
    (r"h\.(\d+)\.attn\.c_proj\.(weight|bias)", r"model.decoder.layers.\1.self_attn.out_proj.\2"),
    (r"h\.(\d+)\.mlp\.c_fc\.(weight|bias)", r"model.decoder.layers.\1.fc1.\2"),
    (r"h\.(\d+)\.mlp\.c_proj\.(weight|bias)", r"model.decoder.layers.\1.fc2.\2"),
]
_C_ATTN = re.compile(r"h\.(\d+)\.attn\.c_attn\.(weight|bias)")
# the causal-mask buffers older checkpoints carry
_MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


def gpt2_args(hf: Mapping, max_model_len: int) -> OPTArgs:
    for key, supported in _REFUSED.items():
        if bool(hf.get(key, supported)) != supported:
            raise ValueError(f"GPT-2 models with {key}={hf[key]!r} are not supported by jaxserve.")
    # reorder_and_upcast_attn only moves where the scores round; attention here runs in float32.
    hidden, heads = hf["n_embd"], hf["n_head"]
    return OPTArgs(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf.get("n_inner") or 4 * hidden,
        num_layers=hf["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        word_embed_proj_dim=hidden,
        num_positions=hf["n_positions"],
        position_offset=0,
        pre_norm=True,
        final_norm=True,
        norm_affine=True,
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        bias=True,
        activation=hf.get("activation_function", "gelu_new"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    ).check_len(max_model_len)


def gpt2_names(name: str, tensor: np.ndarray, args: OPTArgs) -> Iterator[tuple[str, np.ndarray]]:
    """One GPT-2 checkpoint tensor -> the OPT-named tensors it holds."""
    short = name.removeprefix("transformer.")
    if _MASK_BUFFER.fullmatch(short):
        return
    conv = tensor.T if tensor.ndim == 2 else tensor  # Conv1D [in, out] -> Linear [out, in]
    m = _C_ATTN.fullmatch(short)
    if m:
        layer, kind = m.groups()
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), np.split(conv, 3, axis=0)):
            yield f"model.decoder.layers.{layer}.self_attn.{proj}.{kind}", part
        return
    for pattern, target in _RENAMES:
        if re.fullmatch(pattern, short):
            is_embedding = pattern.startswith(("wte", "wpe"))
            yield re.sub(pattern, target, short), tensor if is_embedding else conv
            return
    yield name, tensor  # lm_head.weight (skipped when tied), or unknown: the loader names it
