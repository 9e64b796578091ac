"""Pipeline parallelism on 8 fake CPU devices: a 4-layer GQA Llama gives transformers' greedy
tokens at (pp, tp) = (1, 1), (4, 2) and (4, 1), the same seeded samples and structured
outputs, and every device holds only its stage's layers (a quarter of each stack and of
the KV pool's pages at pp = 4) split by its tensor-parallel group; the same tokens at pp = 1 and
pp = 4 with int8 weights and an int8 KV cache (each stage reads its own layers' KV scales) and
for a GGUF of 4-bit projections (the native kernel's stacks, read by layer index); peft's tokens
with two LoRA adapters and transformers' for OPT at pp = 2 x tp = 2, and transformers' tokens from
an engine with a draft model, offloaded weights and a sleep at pp = 2 x tp = 2. Every step of 64 tokens
goes through the stages as 4 microbatches (a microbatch of at least 16 tokens here), and a
recorded timeline shows the ticks' order. A layer count the stages do
not divide, and more stages than devices, are one-line errors.

The device count is fixed when JAX starts, so the engines run in one fresh subprocess."""

from __future__ import annotations

import collections
import json
import textwrap

import gguf
import pytest
from loader.tiny_checkpoints import write_tiny_gguf
from reference_checks import check_greedy
from tiny_models import (
    TP_LLAMA,
    make_checkpoint,
    make_lora_adapter,
    run_on_fake_devices,
)

from jaxserve.args import EngineArgs

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from tiny_models import engine_kwargs
    from jaxserve import LLM, SamplingParams
    from jaxserve.layers.pipeline import record_timeline
    from jaxserve.lora.request import LoRARequest
    from jaxserve.sampling_params import StructuredOutputsParams

    paths, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    ids = [{"prompt_token_ids": p} for p in prompts]
    small = [{"prompt_token_ids": [t % 200 for t in p]} for p in prompts]  # (the GGUF's vocabulary)
    GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    GUIDED = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True))

    def kw(**overrides):  # a step of the 64-token bucket passes the stages as 4 microbatches (ridge 16)
        k = engine_kwargs(**overrides)
        return {**k, "compilation_config": {**k["compilation_config"], "pipeline_microbatch_tokens": 16}}

    def shards(x):
        return sorted({tuple(s.data.shape) for s in x.addressable_shards})

    def tokens(outs):
        return [list(o.outputs[0].token_ids) for o in outs]

    report = {}
    for pp, tp in ((1, 1), (4, 2), (4, 1)):
        llm = LLM(paths["llama"], **kw(tensor_parallel_size=tp, pipeline_parallel_size=pp))
        runner = llm.llm_engine.runner
        stack = dict(runner.state.flat_state())[("layers", "q_proj")].value
        report[f"llama {pp}x{tp}"] = {
            "pool": shards(runner.kv_pool), "pool_shape": list(runner.kv_pool.shape),
            "q_proj": shards(stack), "q_proj_shape": list(stack.shape),
            "greedy": tokens(llm.generate(ids, GREEDY, use_tqdm=False)),
            "seeded": tokens(llm.generate(ids, SEEDED, use_tqdm=False)),
        }
        if tp == 2 or pp == 1:
            report[f"llama {pp}x{tp}"]["guided"] = [o.outputs[0].text for o in llm.generate(ids, GUIDED, use_tqdm=False)]
        del llm, runner
    # one prefill step of 4 microbatches through 4 stages, stamped as each stage starts and ends each
    with record_timeline() as timeline:
        llm = LLM(paths["llama"], **kw(tensor_parallel_size=2, pipeline_parallel_size=4))
        one = SamplingParams(temperature=0.0, max_tokens=1)
        report["timeline"] = {"prompt": list(range(3, 43)), "events": timeline.events}
        report["timeline"]["token"] = tokens(llm.generate([{"prompt_token_ids": list(range(3, 43))}], one,
                                                          use_tqdm=False))[0]
    del llm
    # the draft model's proposals (itself, on the same stages), weights offloaded to host memory,
    # and a sleep and wake, in one engine
    llm = LLM(paths["llama"], enable_sleep_mode=True, cpu_offload_gb=1,
              speculative_config={"model": paths["llama"], "num_speculative_tokens": 3},
              **kw(tensor_parallel_size=2, pipeline_parallel_size=2))
    before = tokens(llm.generate(ids, GREEDY, use_tqdm=False))
    llm.sleep(1)
    llm.wake_up()
    report["combined 2x2"] = {"tokens": before, "after_sleep": tokens(llm.generate(ids, GREEDY, use_tqdm=False)),
                              "accepted": llm.llm_engine.scheduler.spec_stats.num_accepted_tokens,
                              "host_bytes": sum(v.value.nbytes for _, v in llm.llm_engine.runner.state.flat_state()
                                                if v.value.sharding.memory_kind == "pinned_host")}
    del llm
    for pp, tp in ((1, 1), (4, 2)):
        llm = LLM(paths["llama"], quantization="int8", kv_cache_dtype="int8", calculate_kv_scales=True,
                  **kw(tensor_parallel_size=tp, pipeline_parallel_size=pp))
        report[f"int8 {pp}x{tp}"] = tokens(llm.generate(ids, GREEDY, use_tqdm=False))
        del llm
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths["adapters"])] + [None]
    loras = (loras * len(prompts))[: len(prompts)]
    llm = LLM(paths["llama"], enable_lora=True, max_loras=2, max_lora_rank=8,
              **kw(tensor_parallel_size=2, pipeline_parallel_size=2))
    report["lora 2x2"] = tokens(llm.generate(ids, GREEDY, use_tqdm=False, lora_request=loras))
    del llm
    for pp in (1, 2):
        llm = LLM(paths["gguf"], **kw(pipeline_parallel_size=pp))
        report[f"gguf {pp}"] = tokens(llm.generate(small, GREEDY, use_tqdm=False))
        del llm
    llm = LLM(paths["opt"], **kw(tensor_parallel_size=2, pipeline_parallel_size=2))
    report["opt 2x2"] = tokens(llm.generate(ids, GREEDY, use_tqdm=False))
    del llm
    for bad in ({"pipeline_parallel_size": 3}, {"pipeline_parallel_size": 4, "tensor_parallel_size": 4}):
        try:
            LLM(paths["llama"], **kw(**bad))
        except ValueError as e:
            report.setdefault("errors", []).append(str(e))
    print(json.dumps(report))
    """
)

PROMPTS = [[5, 17, 300, 42, 9], list(range(20, 51)), [7], [9, 10, 11, 12] * 3]
LAYERS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    paths = {"llama": str(root / "llama"), "opt": str(root / "opt")}
    llama = make_checkpoint(
        paths["llama"],
        "LlamaConfig",
        "LlamaForCausalLM",
        {**TP_LLAMA, "num_hidden_layers": LAYERS},
        "float32",
        0,
    )
    paths["adapters"], adapted = [], []
    for i, rank in enumerate((8, 4)):
        adapter = str(root / f"adapter{i}")
        base = make_checkpoint(
            adapter + "-base",
            "LlamaConfig",
            "LlamaForCausalLM",
            {**TP_LLAMA, "num_hidden_layers": LAYERS},
            "float32",
            0,
        )
        adapted.append(
            make_lora_adapter(base, adapter, rank, 2 * rank, ["q_proj", "v_proj", "down_proj"], 30 + i)
        )
        paths["adapters"].append(adapter)
    opt = make_checkpoint(
        paths["opt"],
        "OPTConfig",
        "OPTForCausalLM",
        {"ffn_dim": 128, "num_hidden_layers": LAYERS},
        "float32",
        1,
    )
    Q = gguf.GGMLQuantizationType
    paths["gguf"] = write_tiny_gguf(
        str(root / "q4.gguf"), tied=True, proj_type=Q.Q4_1, ffn_down_type=Q.Q4_K
    ).path
    out = run_on_fake_devices(SCRIPT, json.dumps(paths), json.dumps(PROMPTS))
    models = {"llama": llama, "opt": opt, "adapted": adapted}
    return models, json.loads(out.strip().splitlines()[-1])


def test_every_stage_count_gives_transformers_greedy_tokens(runs):
    models, report = runs
    base = report["llama 1x1"]
    for prompt, generated in zip(PROMPTS, base["greedy"]):
        compared, _ = check_greedy(models["llama"], prompt, generated)
        assert compared >= 6
    for key in ("llama 4x2", "llama 4x1"):
        for field in ("greedy", "seeded", "guided"):
            assert report[key].get(field, base[field]) == base[field], (key, field)
    assert "guided" in report["llama 4x2"]


def test_a_prefill_step_passes_its_microbatches_through_the_stages_in_ticks(runs):
    """The 40-token prompt's step (the 64-token bucket, 16 tokens a microbatch) at pp=4 x tp=2:
    every device of every stage starts and ends each of the 4 microbatches once, in order, and
    a stage starts a microbatch only after the stage before it has ended it."""
    models, report = runs
    timeline = report["timeline"]
    compared, _ = check_greedy(models["llama"], timeline["prompt"], timeline["token"])
    assert compared == 1
    stages, micro, tp = 4, 4, 2
    events = sorted(map(tuple, timeline["events"]))
    assert len(events) == stages * micro * tp * 2 and {e[3] for e in events} == {micro}
    at = collections.defaultdict(list)
    for seconds, stage, m, _, kind in events:
        at[stage, m, kind].append(seconds)
    for stage in range(stages):
        order = [m for _, s, m, _, kind in events if s == stage and kind == "start"]
        assert order == sorted(order) == [m for m in range(micro) for _ in range(tp)], stage
        for m in range(micro):
            assert all(len(at[stage, m, kind]) == tp for kind in ("start", "end"))
            assert max(at[stage, m, "start"]) <= min(at[stage, m, "end"])
            if stage:
                assert min(at[stage, m, "start"]) >= min(at[stage - 1, m, "end"]), (stage, m)


def test_draft_proposals_offload_and_sleep_work_in_stages(runs):
    _, report = runs
    combined = report["combined 2x2"]
    assert combined["tokens"] == combined["after_sleep"] == report["llama 1x1"]["greedy"]
    assert combined["accepted"] > 0 and combined["host_bytes"] > 0


def test_each_device_holds_its_stage_of_layers_and_pages(runs):
    _, report = runs
    pages, heads, slots, dim = report["llama 1x1"]["pool_shape"]
    layers, embed, q = report["llama 1x1"]["q_proj_shape"]
    assert layers == LAYERS
    for key, pp, tp in (("llama 4x2", 4, 2), ("llama 4x1", 4, 1)):
        assert report[key]["pool"] == [[pages // pp, heads // tp, slots, dim]], key
        assert report[key]["q_proj"] == [[layers // pp, embed, q // tp]], key


def test_quantized_lora_gguf_and_opt_models_split_into_stages(runs):
    models, report = runs
    assert report["int8 4x2"] == report["int8 1x1"]
    assert report["gguf 2"] == report["gguf 1"]
    # each prompt's adapter (peft's model), or the base model
    references = ([*models["adapted"], models["llama"]] * len(PROMPTS))[: len(PROMPTS)]
    for reference, prompt, generated in zip(references, PROMPTS, report["lora 2x2"]):
        assert check_greedy(reference, prompt, generated)[0] >= 6
    assert report["lora 2x2"] != report["llama 1x1"]["greedy"]  # the adapters change the tokens
    for prompt, generated in zip(PROMPTS, report["opt 2x2"]):
        assert check_greedy(models["opt"], prompt, generated)[0] >= 6


def test_stages_that_cannot_be_built_are_named(runs, tmp_path):
    _, report = runs
    assert report["errors"] == [
        "pipeline_parallel_size=3 does not divide the model's 4 layers into equal stages; choose a divisor of 4.",
        "tensor_parallel_size=4 x pipeline_parallel_size=4 x data_parallel_size=1 needs that many devices; 8 visible.",
    ]
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer, got 0"):
        EngineArgs(model="unused", pipeline_parallel_size=0).create_engine_config()


@pytest.mark.parametrize("bad", [-1, 1.5, "256", True])
def test_a_bad_microbatch_size_is_one_line(tiny_llama_gqa, bad):
    args = EngineArgs(model=tiny_llama_gqa[0], compilation_config={"pipeline_microbatch_tokens": bad})
    with pytest.raises(ValueError, match="pipeline_microbatch_tokens must be an integer >= 0, got"):
        args.create_engine_config()


def test_microbatches_default_to_the_chips_ridge_point():
    """The rows a chip computes while it reads a bf16 weight matrix once (peak bf16 flops / HBM
    bytes per second): v5e 197e12 / 819e9, v6e 918e12 / 1640e9, v5p 459e12 / 2765e9; a device
    the table does not know (a CPU) has none, and the engine takes 256."""
    from jaxserve.chips import ridge_tokens

    assert [ridge_tokens(kind) for kind in ("TPU v5 lite", "TPU v6 lite", "TPU v5", "cpu")] == [
        241,
        560,
        166,
        None,
    ]
