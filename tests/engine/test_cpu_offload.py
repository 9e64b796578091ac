"""CPU weight offload (`--cpu-offload-gb`): layer stacks in pinned host memory, each layer's slice
copied in by the step; the tokens are the same as with every weight on the device (greedy and
seeded), also after sleeping and waking, and at tensor parallel 2."""

from __future__ import annotations

import json
import logging
import textwrap

import pytest
from tiny_models import engine_kwargs, run_on_fake_devices

from jaxserve import LLM, SamplingParams

PROMPTS = [[5, 9, 17, 33, 2, 8, 100, 7], list(range(3, 70)), [44] * 3]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
]


def run(llm: LLM) -> list[list[list[int]]]:
    return [
        [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        ]
        for sp in PARAMS
    ]


@pytest.fixture(scope="module")
def on_device(tiny_llama_gqa):
    return run(LLM(tiny_llama_gqa[0], **engine_kwargs()))


def memory_kinds(llm: LLM) -> dict[str, str]:
    state = llm.llm_engine.runner.state
    return {
        "/".join(map(str, path)): var.get_value().sharding.memory_kind for path, var in state.flat_state()
    }


def test_every_layer_stack_offloaded_gives_the_same_tokens(tiny_llama_gqa, on_device, caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.model_runner"):
        llm = LLM(tiny_llama_gqa[0], cpu_offload_gb=1.0, enable_sleep_mode=True, **engine_kwargs())
    kinds = memory_kinds(llm)
    host = {k for k, v in kinds.items() if v == "pinned_host"}
    assert host == {k for k in kinds if k.startswith("layers/")}  # (a tiny model: all of them)
    assert kinds["embed_tokens"] == kinds["lm_head"] == "device"
    assert "MiB of it in host memory" in caplog.text
    assert run(llm) == on_device
    llm.sleep(1)
    llm.wake_up()
    assert memory_kinds(llm) == kinds and run(llm) == on_device


def test_a_budget_moves_the_largest_stacks_first(tiny_llama_gqa, on_device):
    """64 KiB: the MLP's largest stack (2 layers x 64 x 128 float32) and no more."""
    llm = LLM(tiny_llama_gqa[0], cpu_offload_gb=64 / 2**20, **engine_kwargs())
    kinds = memory_kinds(llm)
    assert sorted(k for k, v in kinds.items() if v == "pinned_host") == ["layers/down_proj"]
    assert run(llm) == on_device


TP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from tiny_models import engine_kwargs
    from jaxserve import LLM, SamplingParams

    llm = LLM(sys.argv[1], cpu_offload_gb=1.0, tensor_parallel_size=2, **engine_kwargs())
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    kinds = {var.get_value().sharding.memory_kind for _, var in llm.llm_engine.runner.state.flat_state()}
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "kinds": sorted(kinds)}))
    """
)


def test_offload_at_tensor_parallel_two(tiny_llama_gqa, on_device):
    out = run_on_fake_devices(TP_SCRIPT, tiny_llama_gqa[0], json.dumps(PROMPTS), devices=2)
    report = json.loads(out.splitlines()[-1])
    assert report["kinds"] == ["device", "pinned_host"] and report["tokens"] == on_device[0]
