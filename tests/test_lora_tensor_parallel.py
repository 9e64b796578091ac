"""LoRA under tensor parallelism on 8 fake CPU devices: a GQA Llama with two adapters (one with
LoRA biases) and the base model in one batch gives the same greedy tokens at tp = 1, 4 (with
--fully-sharded-loras) and 8 (more devices than KV heads: B of k/v copied with the heads), each
token peft's; each device holds only its slice of the adapters' factors: B split like the outputs
of a projection split by outputs, A like the inputs of one split by inputs, and with
--fully-sharded-loras the other factor split along the rank.

The device count is fixed when JAX starts, so the engines run in one fresh subprocess."""

from __future__ import annotations

import json
import textwrap

import pytest
from reference_checks import check_greedy
from tiny_models import TP_LLAMA, make_checkpoint, make_lora_adapter, run_on_fake_devices

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from tiny_models import engine_kwargs
    from jaxserve import LLM, SamplingParams
    from jaxserve.lora.request import LoRARequest

    path, adapters, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)] + [None]
    report = {}
    for tp, fully in ((1, False), (4, True), (8, False)):
        llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=8, enable_lora_bias=True,
                  fully_sharded_loras=fully, **engine_kwargs(tensor_parallel_size=tp))
        runner = llm.llm_engine.runner
        shards = {}
        for key, var in runner.state.flat_state():
            name = ".".join(map(str, key))
            if "_lora_" in name:
                shards[name] = sorted({tuple(s.data.shape) for s in var.value.addressable_shards})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False, lora_request=loras)
        report[f"{tp}"] = {"tokens": [o.outputs[0].token_ids for o in outs], "shards": shards}
        del llm, runner
    print(json.dumps(report))
    """
)

PROMPTS = [[5, 17, 300, 42, 9], list(range(20, 51)), [7, 8]]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-lora-llama")
    base = make_checkpoint(path, "LlamaConfig", "LlamaForCausalLM", TP_LLAMA, "float32", 0)
    adapters, models = [], []
    for i, (rank, bias) in enumerate(((8, True), (4, False))):
        adapter = str(tmp_path_factory.mktemp(f"tp-lora-{i}"))
        models.append(make_lora_adapter(base, adapter, rank, 2 * rank, TARGETS, 30 + i, lora_bias=bias))
        adapters.append(adapter)
    out = run_on_fake_devices(SCRIPT, str(path), json.dumps(adapters), json.dumps(PROMPTS))
    return json.loads(out.strip().splitlines()[-1]), [*models, base]


def test_every_tensor_parallel_size_gives_pefts_tokens(runs):
    report, models = runs
    for prompt, tokens, model in zip(PROMPTS, report["1"]["tokens"], models):
        compared, total = check_greedy(model, prompt, tokens)
        assert total == 12 and compared >= 10
    assert len({tuple(t) for t in report["1"]["tokens"]}) == 3  # each adapter its own text
    for tp in ("4", "8"):
        assert report[tp]["tokens"] == report["1"]["tokens"], tp


def test_each_device_holds_its_slice_of_the_adapters(runs):
    report, _ = runs
    layers, slots, rank, hidden, heads, head_dim = 2, 2, 8, 64, 8, 8
    q, mlp = heads * head_dim, 128
    full = report["1"]["shards"]
    assert full["layers.qkv_proj_lora_a"] == [[layers, slots, hidden, 3, rank]]  # one A for q, k and v
    assert full["layers.k_proj_lora_b"] == [
        [layers, slots, rank, 2 * head_dim]
    ]  # the checkpoint's 2 KV heads
    # tp 8: outputs split (B of q/k/v, their biases), inputs split (A of o/down); KV heads copied to 8
    tp8 = report["8"]["shards"]
    assert tp8["layers.qkv_proj_lora_a"] == [[layers, slots, hidden, 3, rank]]
    assert tp8["layers.q_proj_lora_b"] == [[layers, slots, rank, q // 8]]
    assert tp8["layers.k_proj_lora_b"] == [[layers, slots, rank, head_dim]]
    assert tp8["layers.k_proj_lora_bias"] == [[layers, slots, head_dim]]
    assert tp8["layers.o_proj_lora_a"] == [[layers, slots, q // 8, 1, rank]]
    assert tp8["layers.o_proj_lora_b"] == [[layers, slots, rank, hidden]]
    assert tp8["layers.down_proj_lora_a"] == [[layers, slots, mlp // 8, 1, rank]]
    # tp 4, fully sharded: the replicated factor of each projection split along the rank
    tp4 = report["4"]["shards"]
    assert tp4["layers.qkv_proj_lora_a"] == [[layers, slots, hidden, 3, rank // 4]]
    assert tp4["layers.q_proj_lora_b"] == [[layers, slots, rank, q // 4]]
    assert tp4["layers.o_proj_lora_a"] == [[layers, slots, q // 4, 1, rank]]
    assert tp4["layers.o_proj_lora_b"] == [[layers, slots, rank // 4, hidden]]
