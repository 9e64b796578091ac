"""Tensor parallelism on 8 fake CPU devices: the same greedy tokens at tp = 1, 2 and 8 (the
KV heads split, then copied) for a GQA Llama with fewer KV heads than devices, the same with
int8 weights and an int8 KV cache, and a Mixtral with expert parallelism (the float Llama at tp = 2
with a draft model's proposals); and every device holding only its own slice of each weight (and
of each quantization scale) and of the KV pool, before and after a sleep (sleep mode) at either
level. The Llama run also serves it as an embedding model at tp = 1 and 2, and a BERT and a
ModernBERT encoder at tp = 2 (their vocabularies padded to split).

The device count is fixed when JAX starts, so the engines run in one fresh subprocess."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import numpy as np
import pytest
import torch
import transformers
from reference_checks import (
    assert_vectors_close,
    check_greedy,
    kv_quantized_reference,
    pooled_reference,
    quantized_reference,
)
from tiny_models import (
    TP_LLAMA,
    engine_kwargs,
    make_checkpoint,
    make_encoder_checkpoint,
    make_modernbert,
    run_on_fake_devices,
)

from jaxserve.args import EngineArgs
from jaxserve.config import ParallelConfig
from jaxserve.loader.model_loader import build_model_args

TP_MIXTRAL = {**TP_LLAMA, "num_local_experts": 8, "num_experts_per_tok": 2}

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    from tiny_models import engine_kwargs
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.model_runner import bytes_per_device
    from jaxserve.sampling_params import StructuredOutputsParams

    SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
              "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": False}

    path, prompts, expert_parallel = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "ep"
    quantization = None if sys.argv[4] == "-" else sys.argv[4]
    kv_cache_dtype = sys.argv[5]
    report = {}
    for tp in (1, 2, 8):
        # the float Llama at tp = 2 proposes tokens with a draft model (itself) on the same mesh:
        # the draft's runner and the verify steps split like the rest
        spec = tp == 2 and quantization is None and not expert_parallel
        embeds = quantization is None and not expert_parallel  # prompts given as embeddings too
        llm = LLM(path, **engine_kwargs(tensor_parallel_size=tp, enable_expert_parallel=expert_parallel,
                                        quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                                        enable_sleep_mode=True, enable_prompt_embeds=embeds,
                                        speculative_config={"model": path, "num_speculative_tokens": 3} if spec else None))
        runner = llm.llm_engine.runner
        shards = {}
        for key, var in runner.state.flat_state():
            x = var.value
            shards[".".join(map(str, key))] = {
                "shape": list(x.shape),
                "devices": len({s.device for s in x.addressable_shards}),
                "shard_shapes": sorted({tuple(s.data.shape) for s in x.addressable_shards}),
            }
        pool = runner.kv_pool  # donated to the first step: read it now
        pool = {"shape": list(pool.shape), "shard_shapes": sorted({tuple(s.data.shape) for s in pool.addressable_shards}),
                "dtype": str(pool.dtype)}
        kv_scales = None if runner.kv_scales is None else runner.kv_scales.tolist()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
            use_tqdm=False,
        )
        from_embeds = []
        if embeds:
            from safetensors.numpy import load_file
            table = load_file(f"{path}/model.safetensors")["model.embed_tokens.weight"]
            from_embeds = llm.generate([{"prompt_embeds": table[p]} for p in prompts],
                                       SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        guided = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
            use_tqdm=False,
        )
        after_sleep = []  # each sleep level, then wake_up: the same tokens from the same slices
        for level in (1, 2) if tp == 8 else ():
            llm.sleep(level)
            llm.wake_up()
            again = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
            slices = {".".join(map(str, k)): sorted({tuple(s.data.shape) for s in v.value.addressable_shards})
                      for k, v in runner.state.flat_state()}
            after_sleep.append({"tokens": [o.outputs[0].token_ids for o in again],
                                "same_slices": all(list(map(list, slices[k])) == list(map(list, shards[k]["shard_shapes"]))
                                                   for k in shards)})
        report[tp] = {
            "after_sleep": after_sleep,
            "tokens": [o.outputs[0].token_ids for o in outs],
            "from_embeds": [o.outputs[0].token_ids for o in from_embeds],
            "guided": [o.outputs[0].text for o in guided],
            "weights": shards,
            "weight_bytes": sum(x.nbytes for x in jax.tree.leaves(runner.state)),
            "fullest_device_bytes": max(bytes_per_device(runner.state).values()),
            "pool": pool,
            "kv_scales": kv_scales,
            "accepted": llm.llm_engine.scheduler.spec_stats.num_accepted_tokens if spec else None,
        }
        del llm, runner, pool
    if not expert_parallel:  # a converted checkpoint holds 2 KV heads; served at tp = 8 it needs copies
        from jaxserve.args import EngineArgs
        from jaxserve.cli import convert

        out = convert(EngineArgs(model=path, **engine_kwargs(quantization=quantization)), path + "-orbax")
        llm = LLM(out, **engine_kwargs(tensor_parallel_size=8, kv_cache_dtype=kv_cache_dtype))
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
            use_tqdm=False,
        )
        report["orbax_tp8"] = {"tokens": [o.outputs[0].token_ids for o in outs]}
    if not expert_parallel and quantization is None:  # served as an embedding model, split the same way
        report["embeddings"] = {}
        for tp in (1, 2):
            llm = LLM(path, runner="pooling", pooler_config={"pooling_type": "MEAN"},
                      **engine_kwargs(tensor_parallel_size=tp))
            outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
            report["embeddings"][tp] = [o.outputs.embedding for o in outs]
    report["encoder"] = {}
    for encoder in json.loads(sys.argv[6]) if len(sys.argv) > 6 else ():  # BERT, ModernBERT at tp = 2
        llm = LLM(encoder, **engine_kwargs(tensor_parallel_size=2, max_num_batched_tokens=128, max_model_len=96))
        tok = llm.get_tokenizer()
        encodings = [tok(*texts) for texts in json.loads(sys.argv[7])]
        outs = llm.embed([{"prompt_token_ids": e["input_ids"]} for e in encodings], use_tqdm=False)
        report["encoder"][encoder] = [{"ids": e["input_ids"], "types": e["token_type_ids"],
                                       "vector": o.outputs.embedding} for e, o in zip(encodings, outs)]
    print(json.dumps(report))
    """
)

PROMPTS = [[5, 17, 300, 42, 9], list(range(20, 51)), [7], [9, 10, 11, 12] * 3]


ENCODER_TEXTS = [
    ["the quick brown fox jumps over the lazy dog"],
    ["paris is the capital of france", "berlin"],
]


def _run(
    path: str, expert_parallel: bool, quantization: str | None, kv_cache_dtype: str, *encoder: str
) -> dict:
    out = run_on_fake_devices(
        SCRIPT,
        path,
        json.dumps(PROMPTS),
        "ep" if expert_parallel else "-",
        quantization or "-",
        kv_cache_dtype,
        *encoder,
    )
    report = json.loads(out.strip().splitlines()[-1])
    return {int(k) if k.isdigit() else k: r for k, r in report.items()}


@pytest.fixture(scope="module", params=["llama", "llama-int8", "mixtral"])
def tp_runs(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"tp-{request.param}"))
    if request.param == "mixtral":
        model = make_checkpoint(path, "MixtralConfig", "MixtralForCausalLM", TP_MIXTRAL, "float32", 0)
    else:
        model = make_checkpoint(path, "LlamaConfig", "LlamaForCausalLM", TP_LLAMA, "float32", 0)
    quantization = kv_cache_dtype = None
    if request.param.endswith("int8"):
        quantization, kv_cache_dtype = "int8", "int8"
    encoders = {}  # path -> the torch model
    if request.param == "llama":
        encoders[path + "-bert"] = make_encoder_checkpoint(path + "-bert", "bert")
        encoders[path + "-modernbert"] = make_modernbert(path + "-modernbert")
    encoder_args = (json.dumps(list(encoders)), json.dumps(ENCODER_TEXTS)) if encoders else ()
    runs = _run(path, request.param == "mixtral", quantization, kv_cache_dtype or "auto", *encoder_args)
    runs["encoder"] = [(encoders[p], r) for p, r in runs["encoder"].items()]
    if quantization:  # the reference: transformers with the same quantized weights and KV
        scales = np.asarray(runs[1]["kv_scales"])
        model = kv_quantized_reference(quantized_reference(model, quantization), scales, kv_cache_dtype)
    return request.param, model, runs


def test_greedy_tokens_are_the_same_at_every_tensor_parallel_size(tp_runs):
    family, model, runs = tp_runs
    for tp in (2, 8, "orbax_tp8"):
        if tp in runs:
            assert runs[tp]["tokens"] == runs[1]["tokens"], f"tp={tp}"
    if family == "llama":  # with a draft model (itself) at tp = 2, its proposals kept
        assert runs[2]["accepted"] > 0
        for tp in (1, 2, 8):  # prompts given as their embeddings: their tokens' own completions
            assert runs[tp]["from_embeds"] == runs[1]["tokens"], f"tp={tp}"
    for level, run in zip((1, 2), runs[8]["after_sleep"], strict=True):  # asleep and awake again
        assert run["tokens"] == runs[1]["tokens"] and run["same_slices"], f"sleep level {level}"
    for tp in (2, 8):  # under a JSON schema too: the mask is applied to replicated logits
        assert runs[tp]["guided"] == runs[1]["guided"], f"tp={tp}"
    for text in runs[1]["guided"]:
        value = json.loads(text)
        assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 999
    for prompt, tokens in zip(PROMPTS, runs[1]["tokens"]):
        compared, total = check_greedy(model, prompt, tokens)
        assert total == 16 and compared >= 14
    if family == "llama":  # the pooling model at tp = 1 and 2: transformers' mean hidden state
        for tp in ("1", "2"):
            for prompt, vector in zip(PROMPTS, runs["embeddings"][tp]):
                assert_vectors_close(vector, pooled_reference(model.model, prompt, "MEAN"))
        assert len(runs["encoder"]) == 2
        for encoder, encoder_runs in runs["encoder"]:  # the encoders at tp = 2: transformers' [CLS] state
            bert = isinstance(encoder, transformers.BertModel)
            for run in encoder_runs:
                types = {"token_type_ids": torch.tensor([run["types"]])} if bert else {}
                with torch.no_grad():
                    cls = (
                        encoder(torch.tensor([run["ids"]]), **types).last_hidden_state[0, 0].double().numpy()
                    )
                assert_vectors_close(run["vector"], cls / np.linalg.norm(cls))
            assert 1 in encoder_runs[1]["types"]  # a pair: its second segment typed 1


def test_each_device_holds_only_its_slice(tp_runs):
    family, _, runs = tp_runs
    head_dim = TP_LLAMA["hidden_size"] // TP_LLAMA["num_attention_heads"]
    kv_heads = TP_LLAMA["num_key_value_heads"]
    for tp, run in runs.items():
        if tp in ("orbax_tp8", "embeddings", "encoder"):
            continue
        w = run["weights"]
        assert all(entry["devices"] == tp for entry in w.values())

        def shard(name, w=w):
            (shape,) = w[name]["shard_shapes"]  # every device's slice has the same shape
            return tuple(shape)

        layers, hidden, vocab = TP_LLAMA["num_hidden_layers"], TP_LLAMA["hidden_size"], TP_LLAMA["vocab_size"]
        assert shard("embed_tokens") == (vocab // tp, hidden)
        assert shard("lm_head") == (hidden, vocab // tp)
        assert shard("layers.q_proj") == (layers, hidden, 8 * head_dim // tp)
        assert shard("layers.o_proj") == (layers, 8 * head_dim // tp, hidden)
        if family.endswith("int8"):  # each output channel's scale lives with the channel
            assert shard("layers.q_proj_scale") == (layers, 8 * head_dim // tp)
            assert shard("layers.o_proj_scale") == (layers, hidden)
        # whole KV heads on every device: copies once tp exceeds the checkpoint's KV heads
        kv_per_device = max(kv_heads // tp, 1)
        assert shard("layers.k_proj") == (layers, hidden, kv_per_device * head_dim)
        assert shard("layers.v_proj") == (layers, hidden, kv_per_device * head_dim)
        pages, combined, page, hd = run["pool"]["shape"]
        assert combined == 2 * max(kv_heads, tp) and hd == head_dim
        assert run["pool"]["shard_shapes"] == [[pages, 2 * kv_per_device, page, head_dim]]
        assert run["pool"]["dtype"] == ("int8" if family.endswith("int8") else "float32")
        if family.endswith("int8"):  # every size measures the same KV scales
            np.testing.assert_allclose(run["kv_scales"], runs[1]["kv_scales"], rtol=1e-5)
        if family == "mixtral":  # whole experts per device
            experts = TP_MIXTRAL["num_local_experts"]
            gate = w["layers.expert_gate"]
            assert gate["shard_shapes"] == [[layers, experts // tp, *gate["shape"][2:]]]
        else:
            mlp = TP_LLAMA["intermediate_size"]
            assert shard("layers.gate_proj") == (layers, hidden, mlp // tp)
            assert shard("layers.down_proj") == (layers, mlp // tp, hidden)
        # the fullest device holds about 1/tp of the weights (norms and the router are replicated)
        assert run["fullest_device_bytes"] <= run["weight_bytes"] / tp * 1.1 + 4096


@pytest.mark.parametrize(
    "heads, kv_heads, vocab, tp, message",
    [
        (
            4,
            2,
            768,
            3,
            r"Total number of attention heads \(4\) must be divisible by tensor_parallel_size \(3\)",
        ),
        (12, 4, 768, 6, r"tensor_parallel_size \(6\) must be a multiple of the number of KV heads \(4\)"),
        (12, 6, 512, 4, r"Total number of KV heads \(6\) must be divisible by tensor_parallel_size \(4\)"),
        (4, 2, 510, 4, r"vocab_size \(510\) must be divisible by tensor_parallel_size \(4\)"),
    ],
)
def test_shapes_that_do_not_split_are_refused(tiny_llama_gqa, heads, kv_heads, vocab, tp, message):
    config = EngineArgs(model=tiny_llama_gqa[0], **engine_kwargs()).create_engine_config()
    hf = {**config.model_config.hf_config, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    hf["vocab_size"] = vocab
    hf["head_dim"] = 8
    model_config = dataclasses.replace(config.model_config, hf_config=hf)
    with pytest.raises(ValueError, match=message):
        build_model_args(model_config, ParallelConfig(tensor_parallel_size=tp))
    _, args = build_model_args(model_config, ParallelConfig(tensor_parallel_size=2))
    assert args.num_kv_heads == max(kv_heads, 2) and args.kv_head_copies == max(1, 2 // kv_heads)
