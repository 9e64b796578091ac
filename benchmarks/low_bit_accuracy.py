"""How close fp8 weights and fp8 KV pages can come to the float model, whatever the rounding.

`benchmarks/quantization.py` measures what the engine serves: on the default model, fp8 (e4m3)
weights rounded to nearest per output channel score perplexity 1.033x and top-1 agreement 91.6%,
and fp8_e5m2 KV pages 1.044x and 89.3%, against int8's 1.001x and 96.5%. This script asks whether
a smarter rounding or a change of basis would close that gap, on the same weights and the same
text, with Hugging Face transformers as the model (torch: a test dependency, never the engine's):
every variant below rewrites the float weights, or the keys and values attention reads, with the
format's own rounding, and is scored teacher-forced against the unchanged model.

Weights (every decoder projection; embeddings and head kept, as the engine does):
- `fp8-channel`: the engine's rounding (layers/linear.quantize_kernel), per output channel;
- `fp8-tensor`: one scale per tensor (vLLM's online fp8);
- `fp8-gptq-*`: error-compensating rounding onto the same fp8 grid (GPTQ: each input row is
  rounded in turn and its error pushed onto the rows not yet rounded, weighted by the inverse of
  the inputs' second moments X^T X, measured on a calibration text: the engine's KV calibration
  text, or text the model samples itself);
- `fp8-rotated`: inputs and weights turned by a random orthogonal matrix before rounding (the
  product is unchanged in exact arithmetic; QuaRot's remedy for integer formats);
- `int8-channel`: the engine's int8, for scale.
KV pages (scale 1.0, as the engine's fp8 default; keys after rotary embedding):
- `kv-<fmt>`, `kv-<fmt>-keys`, `kv-<fmt>-values`: both, or one of the two, stored in the format;
- `kv-<fmt>-hadamard`: queries and keys turned by a Hadamard matrix per head first (q.k unchanged);
- `kv-e5m2-centered-hadamard`: also each layer's mean key (over the calibration text) taken off
  the keys, which softmax does not see.

    python benchmarks/low_bit_accuracy.py [--model GGUF_OR_DIR] [--variants ...] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import runpy
import sys
from collections.abc import Sequence

import numpy as np

DEFAULT_MODEL = "~/.cache/jaxserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHT_VARIANTS = (
    "fp8-channel",
    "fp8-tensor",
    "fp8-gptq-calibration",
    "fp8-gptq-sampled",
    "fp8-rotated",
    "int8-channel",
)
KV_VARIANTS = (
    "kv-e4m3",
    "kv-e4m3-hadamard",
    "kv-e5m2",
    "kv-e5m2-keys",
    "kv-e5m2-values",
    "kv-e5m2-hadamard",
    "kv-e5m2-centered-hadamard",
)
SAMPLING_PROMPTS = (
    "The",
    "User: Write a short story.\nAssistant:",
    "def main():",
    "In 1850,",
    "Once upon a time",
)


def load(model: str):
    """(tokenizer, float32 transformers model) from a GGUF file or a Hugging Face directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.expanduser(model)
    kw = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
    where = os.path.dirname(path) if kw else path
    tokenizer = AutoTokenizer.from_pretrained(where, **kw)
    return tokenizer, AutoModelForCausalLM.from_pretrained(where, dtype="float32", **kw).eval()


def projections(model):
    """(layer, name, nn.Linear) of every decoder projection."""
    for i, layer in enumerate(model.model.layers):
        for name in PROJECTIONS:
            yield i, name, getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)


def score(model, ids: list[int]):
    """(mean negative log-likelihood, logits [len - 1, vocab]) of the text, teacher-forced."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    nll = -torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean()
    return float(nll), logits


def fp8_scale(amax):
    """The e4m3 scale that maps `amax` (a tensor of largest magnitudes) to the format's largest
    value, as the engine's quantize_kernel does (1 where amax is 0)."""
    import torch

    from jaxserve.layers.linear import WEIGHT_QUANTIZATIONS

    return torch.where(amax > 0, amax / WEIGHT_QUANTIZATIONS["fp8"][1], torch.ones_like(amax))


def round_fp8(w, scale):
    """w / scale rounded to the nearest float8 e4m3 value, times scale (float64 in and out)."""
    import torch

    return (w / scale).float().to(torch.float8_e4m3fn).double() * scale


def engine_rounding(weight, quantization: str):
    """A torch weight [out, in] through the engine's own quantize_kernel (kernel [in, out]),
    dequantized: what the engine's matmul multiplies by."""
    import torch

    from jaxserve.layers.linear import quantize_kernel

    values, scale = quantize_kernel(weight.T.numpy(), quantization)
    return torch.from_numpy((values.astype(np.float32) * scale).T.copy())


def second_moments(model, sequences: list[list[int]]) -> dict:
    """(layer, projection) -> X^T X [in, in] float64 of the projection's inputs over `sequences`."""
    import torch

    moments: dict = {}
    hooks = []
    for i, name, linear in projections(model):

        def hook(module, inputs, output, key=(i, name)):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            moments[key] = moments.get(key, 0) + x.T @ x

        hooks.append(linear.register_forward_hook(hook))
    with torch.no_grad():
        for ids in sequences:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return moments


def gptq_fp8(weight, moments, damp: float, block: int = 128):
    """GPTQ onto the per-output-channel e4m3 grid: weight [out, in], moments X^T X [in, in] ->
    the rounded weight [out, in] (float32). Input rows are rounded in order; each one's error,
    scaled by the inverse Hessian's Cholesky factor, is taken off the rows still to come."""
    import torch

    w = weight.double().clone()
    h = moments.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    scale = fp8_scale(w.abs().amax(1))
    q = torch.zeros_like(w)
    for a in range(0, w.shape[1], block):
        b = min(a + block, w.shape[1])
        chunk, errors = w[:, a:b].clone(), torch.zeros(w.shape[0], b - a, dtype=w.dtype)
        for j in range(b - a):
            q[:, a + j] = round_fp8(chunk[:, j], scale)
            errors[:, j] = (chunk[:, j] - q[:, a + j]) / hinv[a + j, a + j]
            chunk[:, j:] -= errors[:, j : j + 1] * hinv[a + j, a + j : b][None, :]
        w[:, b:] -= errors @ hinv[a:b, b:]
    return q.float()


def random_rotation(n: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diag(r))


def hadamard(n: int):
    """The orthonormal Sylvester-Hadamard matrix of order n (a power of two)."""
    import torch

    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != n:
        raise ValueError(f"no Hadamard matrix of order {n} here (a power of two is needed)")
    return h / math.sqrt(n)


def quantized_weights(model, variant: str, calibration: list[list[int]], sampled: list[list[int]]):
    """A copy of `model` with every decoder projection rewritten by `variant`."""
    out = copy.deepcopy(model)
    moments = {}
    if variant.startswith("fp8-gptq"):
        moments = second_moments(model, calibration if variant.endswith("calibration") else sampled)
    for i, name, linear in projections(out):
        w = linear.weight.data
        if variant in ("fp8-channel", "int8-channel"):
            new = engine_rounding(w, variant.partition("-")[0])
        elif variant == "fp8-tensor":
            new = round_fp8(w.double(), fp8_scale(w.abs().max().double())).float()
        elif variant.startswith("fp8-gptq"):
            new = gptq_fp8(w, moments[(i, name)], damp=0.1 if variant.endswith("calibration") else 0.01)
        elif variant == "fp8-rotated":
            r = random_rotation(w.shape[1], seed=w.shape[1])
            new = (engine_rounding((w.double() @ r).float(), "fp8").double() @ r.T).float()
        else:
            raise ValueError(f"unknown weight variant {variant!r}")
        linear.weight.data = new
    return out


class KVRounding:
    """An attention implementation for transformers that stores keys and values in a low-bit
    format before attending (scale 1.0), optionally turning queries and keys by a Hadamard matrix
    and taking each layer's calibration mean key off first. `dtype` None: exact."""

    NAME = "low_bit_kv"

    def __init__(self):
        self.keys = self.values = None  # torch dtypes, or None (kept in float)
        self.hadamard = self.center = self.collect = False
        self.mean_keys: dict[int, object] = {}

    def __call__(self, module, q, k, v, *args, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.collect:  # k: [batch, kv heads, tokens, head_dim]
            self.mean_keys[module.layer_idx] = k[0].mean(1)[None, :, None, :]
        if self.center:
            k = k - self.mean_keys[module.layer_idx]
        if self.hadamard:
            h = hadamard(q.shape[-1]).to(q.dtype)
            q, k = q @ h, k @ h
        k = k if self.keys is None else k.to(self.keys).to(q.dtype)
        v = v if self.values is None else v.to(self.values).to(q.dtype)
        return sdpa_attention_forward(module, q, k, v, *args, **kwargs)

    def install(self, model) -> None:
        from transformers import AttentionInterface

        AttentionInterface.register(self.NAME, self)
        model.config._attn_implementation = self.NAME
        for layer in model.model.layers:
            layer.self_attn.config._attn_implementation = self.NAME

    def set(self, variant: str | None) -> None:
        import torch

        parts = (variant or "").removeprefix("kv-").split("-")
        fmt = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(parts[0])
        self.keys = fmt if "values" not in parts else None
        self.values = fmt if "keys" not in parts else None
        self.hadamard, self.center, self.collect = "hadamard" in parts, "centered" in parts, False


def sampled_text(model, tokenizer, tokens_each: int = 400) -> list[list[int]]:
    """Text the model writes itself (temperature 1, fixed seed) from a few short prompts."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([tokenizer.encode(p)]),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=tokens_each,
            )[0].tolist()
            for p in SAMPLING_PROMPTS
        ]


def run(ns) -> dict:

    from jaxserve.runner.kv_scales import CALIBRATION_TEXT

    here = os.path.dirname(os.path.abspath(__file__))
    text = runpy.run_path(os.path.join(here, "quantization.py"))["TEXT"]
    tokenizer, model = load(ns.model)
    ids = tokenizer.encode(text)[: ns.text_tokens]
    calibration = [tokenizer.encode(CALIBRATION_TEXT)]
    kv = KVRounding()
    kv.install(model)
    nll0, logits0 = score(model, ids)
    top0 = logits0.argmax(-1)
    sampled = sampled_text(model, tokenizer) if "fp8-gptq-sampled" in ns.variants else []
    if any("centered" in v for v in ns.variants):
        kv.collect = True
        score(model, calibration[0])
        kv.collect = False
    report = {"text_tokens": len(ids), "perplexity": math.exp(nll0), "variants": {}}
    for variant in ns.variants:
        if variant in KV_VARIANTS:
            kv.set(variant)
            nll, logits = score(model, ids)
            kv.set(None)
        else:
            nll, logits = score(quantized_weights(model, variant, calibration, sampled), ids)
        entry = {
            "perplexity_ratio": math.exp(nll - nll0),
            "top1_agreement": float((logits.argmax(-1) == top0).double().mean()),
            "logit_rms_error": float((logits - logits0).pow(2).mean().sqrt()),
        }
        report["variants"][variant] = entry
        print(
            f"{variant:28s} ppl {entry['perplexity_ratio']:.4f}x  top-1 {entry['top1_agreement']:.4f}  "
            f"logit RMS error {entry['logit_rms_error']:.3f}",
            flush=True,
        )
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/low_bit_accuracy.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="A GGUF file or a Hugging Face directory.")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[*WEIGHT_VARIANTS, *KV_VARIANTS],
        choices=[*WEIGHT_VARIANTS, *KV_VARIANTS],
    )
    parser.add_argument("--text-tokens", type=int, default=1024)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    report = run(ns)
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            json.dump({"config": vars(ns), **report}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
