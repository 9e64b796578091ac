"""Swap preemption (`--preemption-mode swap`, `--swap-space`): under a pool too small for the
work, requests are preempted, their pages copied to host memory and back, and every output is the
one an engine that never preempts gives (greedy and seeded sampling); when the swap space cannot
hold a request it recomputes instead; host copies are dropped when requests end."""

from __future__ import annotations

import json
import textwrap

import pytest
from tiny_models import engine_kwargs, run_on_fake_devices

from jaxserve import LLM, SamplingParams
from jaxserve.engine.stats import SchedulerStats

PROMPTS = [[(7 * i + j) % 400 + 3 for j in range(40 + 9 * i)] for i in range(6)]
PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
]


@pytest.fixture(scope="module")
def unpreempted(tiny_llama_gqa):
    """Every output with room for all the requests at once (128 pages of 8)."""
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs(num_gpu_blocks_override=129))
    outs = [
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False) for params in PARAMS
    ]
    assert llm.llm_engine.scheduler.num_preemptions == 0
    return [[o.outputs[0].token_ids for o in run] for run in outs]


def swapping_engine(path: str, swap_space: float) -> LLM:
    """20 pages of 8 for six requests growing to 85-130 tokens: several are preempted."""
    llm = LLM(
        path, preemption_mode="swap", swap_space=swap_space,
        **engine_kwargs(num_gpu_blocks_override=21, enable_prefix_caching=False),
    )  # fmt: skip
    llm.llm_engine.scheduler.swap.min_tokens = 16  # (the tiny model's contexts are short)
    return llm


def test_swapped_requests_resume_where_they_stopped(tiny_llama_gqa, unpreempted):
    llm = swapping_engine(tiny_llama_gqa[0], swap_space=1.0)
    scheduler, runner = llm.llm_engine.scheduler, llm.llm_engine.runner
    for params, want in zip(PARAMS, unpreempted):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    assert scheduler.swap.num_swap_outs > 0 and scheduler.num_preemptions >= scheduler.swap.num_swap_outs
    stats = SchedulerStats.of(scheduler)
    assert stats.swap_out_bytes == scheduler.swap.bytes_out > 0 and stats.num_swapped == 0
    assert scheduler.swap.swapped == {} and runner.swapped.host == {}  # every copy came back or was dropped


def test_a_swap_space_too_small_recomputes(tiny_llama_gqa, unpreempted):
    llm = swapping_engine(tiny_llama_gqa[0], swap_space=1e-7)  # less than one page of every layer
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS[0], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == unpreempted[0]
    scheduler = llm.llm_engine.scheduler
    assert (
        scheduler.swap.num_blocks == 0 and scheduler.swap.num_swap_outs == 0 and scheduler.num_preemptions > 0
    )


def test_a_request_aborted_while_swapped_out_drops_its_copy(tiny_llama_gqa):
    llm = swapping_engine(tiny_llama_gqa[0], swap_space=1.0)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, PARAMS[0])
    while not engine.scheduler.swap.swapped:
        engine.step()
    victim = next(iter(engine.scheduler.swap.swapped))
    engine.abort_request(victim)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.swap.swapped == {} and engine.runner.swapped.host == {}


TP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from tiny_models import engine_kwargs
    from jaxserve import LLM, SamplingParams

    tp, pp = map(int, sys.argv[3:5])
    llm = LLM(sys.argv[1], preemption_mode="swap", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              **engine_kwargs(num_gpu_blocks_override=21, enable_prefix_caching=False))
    llm.llm_engine.scheduler.swap.min_tokens = 16
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                      "swap_outs": llm.llm_engine.scheduler.swap.num_swap_outs}))
    """
)


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_swap_at_tensor_and_pipeline_parallel(tiny_llama_gqa, unpreempted, tp, pp):
    """The pool split over two devices by KV heads (each copy moves each device's heads), and
    also over two stages by layers (each stage's devices hold their layers' pages)."""
    args = (tiny_llama_gqa[0], json.dumps(PROMPTS), str(tp), str(pp))
    out = json.loads(run_on_fake_devices(TP_SCRIPT, *args, devices=tp * pp).splitlines()[-1])
    assert out["swap_outs"] > 0 and out["tokens"] == unpreempted[0]
