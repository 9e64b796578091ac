"""Sleep mode: LLM.sleep frees the weights and the KV pool on the device and wake_up takes them
back, after which the model gives the tokens it gave before (level 1 from a host copy, level 2
from the checkpoint), without compiling anything; requests running across a sleep resume and end
as if nothing had happened."""

from __future__ import annotations

import jax
import pytest
from tiny_models import engine_kwargs, make_lora_adapter

from jaxserve import LLM, SamplingParams
from jaxserve.lora.request import LoRARequest

PROMPTS = [{"prompt_token_ids": [5, 17, 300, 42, 9]}, {"prompt_token_ids": [7, 8, 9, 10, 11, 12, 13, 14, 15]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


@pytest.fixture(scope="module")
def llm(tiny_llama_gqa):
    return LLM(tiny_llama_gqa[0], enable_sleep_mode=True, **engine_kwargs())


@pytest.mark.parametrize("level", [1, 2])
def test_the_model_wakes_as_it_slept_and_compiles_nothing(llm, level):
    want = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    runner = llm.llm_engine.runner
    compiled = runner.num_compiled
    held = _live_bytes()
    weights = sum(var.value.nbytes for _, var in runner.state.flat_state())
    pool = runner.kv_pool.nbytes

    llm.sleep(level)
    assert llm.llm_engine.is_sleeping
    assert all(var.value.is_deleted() for _, var in runner.state.flat_state())
    assert runner.kv_pool.is_deleted()
    assert held - _live_bytes() >= weights + pool  # the device gave back both
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)

    llm.wake_up()
    assert not llm.llm_engine.is_sleeping
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert runner.num_compiled == compiled


def test_waking_part_by_part(llm):
    want = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.sleep(1)
    llm.wake_up(["weights"])  # e.g. to change the weights before the cache is needed again
    runner = llm.llm_engine.runner
    assert not any(var.value.is_deleted() for _, var in runner.state.flat_state())
    assert runner.kv_pool.is_deleted() and llm.llm_engine.is_sleeping
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(["kv_cache"])
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want


def test_sleeping_twice_and_waking_twice(llm):
    want = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.sleep(1)
    llm.sleep(2)  # drops the host copy: waking reads the checkpoint
    assert llm.llm_engine.runner.weights_on_host == 0
    llm.wake_up()
    llm.wake_up()
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want


def test_requests_running_across_a_sleep_end_as_without_it(llm):
    """Preempted by the sleep, they recompute once awake and give the same greedy tokens; the
    prefix cache the sleep emptied holds nothing stale."""
    want = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"across-{i}", prompt, GREEDY)
    finished = {}
    for _ in range(4):  # prefill and a few decode steps
        for out in engine.step():
            finished[out.request_id] = out
    engine.sleep(1)
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 2
    assert engine.step() == []  # asleep: nothing runs
    engine.wake_up()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert [list(finished[f"across-{i}"].outputs[0].token_ids) for i in range(2)] == want


def test_bad_calls_are_named(tiny_llama_gqa, llm):
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="Unknown wake_up tags"):
        llm.wake_up(["weights", "everything"])
    assert not llm.llm_engine.is_sleeping
    plain = LLM(tiny_llama_gqa[0], **engine_kwargs(num_gpu_blocks_override=16))
    with pytest.raises(ValueError, match="--enable-sleep-mode"):
        plain.sleep()


def test_lora_slots_survive_a_level_2_sleep(tiny_llama_gqa, tmp_path):
    """Level 2 reads the base weights from the checkpoint again; the adapters written into the
    LoRA slots are kept and put back."""
    path, base = tiny_llama_gqa
    make_lora_adapter(base, str(tmp_path), 8, 16, ["q_proj", "v_proj"], 7)
    llm = LLM(path, enable_sleep_mode=True, enable_lora=True, max_loras=1, **engine_kwargs())
    lora = LoRARequest("a", 1, str(tmp_path))
    want = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora))
    assert want != _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))  # the adapter matters
    want_base = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)  # the adapter in its slot
    llm.sleep(2)
    llm.wake_up()
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)) == want
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want_base
