"""GGUF projections served in their own groups (--quantization gguf, the default for .gguf):
Q8_0 as int8 groups, Q4_0 / Q4_1 / Q4_K as 4-bit values two a byte with a scale and a min per
group. The groups read from the file dequantize to what the gguf package dequantizes; the model
served quantized gives the logits of the same file dequantized to float32 (--quantization none)
at every prompt position, holding its projections in about a fifth of the bytes. A Q8_0
embedding table is kept in its groups too: the lookup and a tied LM head read it as it is."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from reference_checks import prompt_logits
from tiny_checkpoints import write_tiny_gguf
from tiny_models import engine_kwargs

from jaxserve.args import EngineArgs
from jaxserve.loader.gguf import GroupQuantized, gguf_kernel_formats, iter_gguf_tensors
from jaxserve.runner.model_runner import ModelRunner

Q = gguf.GGMLQuantizationType
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def quantized_gguf(request, tmp_path_factory):
    """Every projection in the type (Q4_K: only the 256-wide ffn_down, the others Q4_1)."""
    path = str(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf")
    if request.param == "Q4_K":
        return request.param, write_tiny_gguf(path, tied=True, proj_type=Q.Q4_1, ffn_down_type=Q.Q4_K)
    return request.param, write_tiny_gguf(path, tied=False, proj_type=Q[request.param])


def test_groups_dequantize_to_what_the_gguf_package_gives(quantized_gguf):
    kind, tiny = quantized_gguf
    formats = gguf_kernel_formats(tiny.path)
    fmt = "q8" if kind == "Q8_0" else "q4"
    assert formats.pop("model.embed_tokens") == "q8"  # the tiny files' embedding is Q8_0
    assert formats == {name: fmt for name in formats} and len(formats) == 7
    tensors = dict(
        iter_gguf_tensors(tiny.path, use_tqdm=False, grouped=frozenset(formats) | {"model.embed_tokens"})
    )
    grouped = {n: t for n, t in tensors.items() if isinstance(t, GroupQuantized)}
    assert len(grouped) == 7 * 2 + 1  # every projection of both layers, and the embedding
    for name, g in grouped.items():
        values = g.values.astype(np.float32).reshape(g.shape[0], -1, 32)
        w = values * g.scale[..., None] + (0 if g.min is None else g.min[..., None])
        np.testing.assert_allclose(w.reshape(g.shape), tiny.tensors[name], rtol=1e-6, atol=1e-6, err_msg=name)
        assert g.values.dtype == (np.int8 if kind == "Q8_0" or "embed_tokens" in name else np.uint8)


def test_served_in_groups_the_logits_are_the_dequantized_models(quantized_gguf):
    kind, tiny = quantized_gguf
    kwargs = engine_kwargs()
    grouped = ModelRunner(EngineArgs(model=tiny.path, **kwargs).create_engine_config())
    plain = ModelRunner(EngineArgs(model=tiny.path, quantization="none", **kwargs).create_engine_config())
    rng = np.random.default_rng(0)
    for n in (1, 9, 45):
        ids = rng.integers(3, 200, size=n).tolist()
        want = prompt_logits(plain, ids)  # (logits of this model's unit-variance weights reach ~50)
        # The native CPU kernel rounds x to int16 per group, and this model's unit-variance layers
        # amplify it: up to ~1.2e-3 of the largest logit here (measured); a wrong group, nibble or
        # tile would be off by about the logits themselves.
        np.testing.assert_allclose(prompt_logits(grouped, ids), want, atol=3e-3 * np.abs(want).max(), rtol=0)
    if kind != "Q8_0":  # on this CPU the 4-bit stacks are laid out in the native kernel's tiles
        kernels = [a for p, a in grouped.state.flat_state() if str(p[-1]) in PROJECTIONS]
        tiled = [a.value for a in kernels if a.value.ndim == 4]  # (those 64 outputs wide or more)
        assert tiled and all(a.shape[-1] == 64 for a in tiled)
    sizes, tables = {}, {}
    for runner in (grouped, plain):
        flat = {".".join(map(str, k)): v.value for k, v in runner.state.flat_state()}
        sizes[runner] = sum(a.nbytes for p, a in flat.items() if p.split(".")[-1].startswith(PROJECTIONS))
        tables[runner] = sum(a.nbytes for p, a in flat.items() if p.startswith("embed_tokens"))
    # float32 kernels: 4 bytes a weight; int8 groups 1 + 4/32; 4 bits two a byte, scale and min 0.5 + 8/32
    want = (1 + 4 / 32) / 4 if kind == "Q8_0" else (0.5 + 8 / 32) / 4
    assert sizes[grouped] / sizes[plain] == pytest.approx(want, rel=0.01)
    assert tables[grouped] / tables[plain] == pytest.approx((1 + 4 / 32) / 4)  # the Q8_0 embedding


def test_a_tensor_parallel_size_that_would_split_a_group_is_refused(quantized_gguf):
    """o_proj's 64 inputs are one pair of 4-bit groups (two Q8_0 groups): tp=2 cannot split the
    former, and says so before anything loads."""
    from jaxserve.config import ParallelConfig
    from jaxserve.loader.model_loader import build_model_args

    kind, tiny = quantized_gguf
    config = EngineArgs(model=tiny.path, **engine_kwargs()).create_engine_config().model_config
    # (the tiny vocabulary of 269 cannot be split either: that check comes after the groups')
    message = (
        "vocab_size"
        if kind == "Q8_0"
        else "tensor_parallel_size=2 does not split the quantization groups of o_proj"
    )
    with pytest.raises(ValueError, match=message):
        build_model_args(config, ParallelConfig(tensor_parallel_size=2))


TP_SCRIPT = """
import json, sys
import numpy as np
from tiny_models import engine_kwargs
from jaxserve import LLM, SamplingParams

path, report = sys.argv[1], {}
for tp in (1, 3):
    llm = LLM(path, **engine_kwargs(tensor_parallel_size=tp, max_model_len=256))
    flat = {".".join(map(str, k)): v.value for k, v in llm.llm_engine.runner.state.flat_state()}
    shards = {p: sorted({tuple(s.data.shape) for s in flat[p].addressable_shards})
              for p in ("layers.o_proj", "layers.o_proj_scale", "layers.down_proj_min", "layers.q_proj",
                        "embed_tokens", "embed_tokens_scale")}
    outs = llm.generate(["The capital of France is", "def fibonacci(n):"],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    report[tp] = {"tokens": [o.outputs[0].token_ids for o in outs], "shards": shards,
                  "dtype": str(flat["layers.o_proj"].dtype)}
    del llm
print(json.dumps(report))
"""


def test_the_default_models_4bit_groups_split_over_three_devices(default_gguf):
    """SmolLM2's 9 heads and 3 KV heads split over 3 (fake) devices: each holds a third of every
    packed kernel and of its group scales (o_proj and down_proj by input, whole pairs of groups
    each) and a third of the Q8_0 embedding's rows, and greedy tokens are those of one device. (The
    steps' 8 logit rows take the tied head through its vocabulary chunks, each device its own.)"""
    import json

    from tiny_models import run_on_fake_devices

    report = json.loads(run_on_fake_devices(TP_SCRIPT, default_gguf, devices=3).strip().splitlines()[-1])
    one, three = report["1"], report["3"]
    assert one["dtype"] == three["dtype"] == "uint8"
    assert three["tokens"] == one["tokens"]
    layers = 30
    assert three["shards"]["layers.o_proj"] == [[layers, 576 // 2 // 3, 576]]  # 576 inputs, two a byte
    assert three["shards"]["layers.o_proj_scale"] == [[layers, 9 // 3, 2, 576]]  # 9 pairs of groups
    assert three["shards"]["layers.down_proj_min"] == [[layers, 24 // 3, 2, 576]]
    assert three["shards"]["layers.q_proj"] == [[layers, 576 // 2, 576 // 3]]  # split by output
    assert three["shards"]["embed_tokens"] == [[49152 // 3, 576]]  # Q8_0 rows, split by vocabulary
    assert three["shards"]["embed_tokens_scale"] == [[49152 // 3, 576 // 32]]
