"""LoRA adapters in device slots against transformers + peft.

Random PEFT adapters (random A and B, not peft's no-op start) of different ranks, targets and
scalings (lora_alpha / r, and rsLoRA's lora_alpha / sqrt(r)) on a tiny Llama: with an adapter
written into a slot, jaxserve's logits at every prompt position equal peft's model with that
adapter; one batch mixing the adapters and the base model gives each row what it gives alone;
and rewriting slots (an adapter evicted and written back elsewhere) compiles nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from reference_checks import GREEDY, compilations, prompt_logits, teacher_forced_logits
from tiny_models import engine_kwargs, make_llama_checkpoint, make_lora_adapter

from jaxserve.args import EngineArgs
from jaxserve.config import LoRAConfig
from jaxserve.lora.adapter import read_adapter
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.scheduler_output import ScheduledSeq, SchedulerOutput

# name: (rank, lora_alpha, use_rslora, target modules)
ADAPTERS = {
    "attn": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": (4, 8, True, ["gate_proj", "up_proj", "down_proj"]),
    "all": (16, 32, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The base checkpoint, and per adapter (its directory, the peft model with it)."""
    base_dir = tmp_path_factory.mktemp("lora-base")
    base = make_llama_checkpoint(base_dir, "gqa")
    made = {}
    for i, (name, (rank, alpha, rslora, targets)) in enumerate(sorted(ADAPTERS.items())):
        path = tmp_path_factory.mktemp(f"lora-{name}")
        made[name] = (str(path), make_lora_adapter(base, path, rank, alpha, targets, 100 + i, rslora))
    return str(base_dir), base, made


def _runner(base_dir: str, max_loras: int = 4) -> ModelRunner:
    config = EngineArgs(model=base_dir, **engine_kwargs()).create_engine_config()
    return ModelRunner(
        dataclasses.replace(config, lora_config=LoRAConfig(max_loras=max_loras, max_lora_rank=16))
    )


def _adapter(runner: ModelRunner, path: str):
    return read_adapter(path, runner.adapter_spec)


def test_logits_equal_peft_with_the_adapter_in_its_slot(adapters):
    base_dir, base, made = adapters
    runner = _runner(base_dir)
    for slot, name in enumerate(sorted(made)):
        runner.set_lora_slot(slot, _adapter(runner, made[name][0]))
    rng = np.random.default_rng(0)
    for n in (1, 9, 45):
        ids = rng.integers(3, 500, size=n).tolist()
        np.testing.assert_allclose(
            prompt_logits(runner, ids), teacher_forced_logits(base, ids), atol=1e-4, rtol=0
        )
        for slot, name in enumerate(sorted(made)):
            want = teacher_forced_logits(made[name][1], ids)
            got = prompt_logits(runner, ids, lora_slot=slot)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"{name}, {n} tokens")
            assert np.abs(want - teacher_forced_logits(base, ids)).max() > 1e-2  # the adapter matters


def test_a_batch_mixing_adapters_gives_each_row_what_it_gives_alone(adapters):
    base_dir, _, made = adapters
    runner = _runner(base_dir)
    names = sorted(made)
    for slot, name in enumerate(names):
        runner.set_lora_slot(slot, _adapter(runner, made[name][0]))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (5, 12, 3, 9)]
    slots = [0, -1, 2, 1]  # three adapters and the base model
    seqs, first = [], 1
    for i, (ids, slot) in enumerate(zip(prompts, slots)):
        pages = tuple(range(first, first + -(-len(ids) // runner.page_size)))
        first += len(pages)
        seqs.append(ScheduledSeq(f"r{i}", tuple(ids), 0, pages, GREEDY, lora_slot=slot))
    inputs = runner.prepare(SchedulerOutput(tuple(seqs)), (64, 4))
    from reference_checks import _forward

    mixed = np.asarray(_forward(runner.graphdef, runner.state, runner.kv_pool, jax.device_put(inputs)))
    for row, (ids, slot) in enumerate(zip(prompts, slots)):
        alone = prompt_logits(runner, ids, lora_slot=slot)[-1]
        np.testing.assert_allclose(mixed[row], alone, atol=1e-5, rtol=0, err_msg=f"row {row}")


def test_slots_are_rewritten_without_compiling(adapters):
    base_dir, base, made = adapters
    runner = _runner(base_dir, max_loras=2)
    attn, mlp = _adapter(runner, made["attn"][0]), _adapter(runner, made["mlp"][0])
    runner.set_lora_slot(0, attn)
    ids = list(range(10, 40))
    prompt_logits(runner, ids, lora_slot=0)
    with compilations() as compiles:
        runner.set_lora_slot(0, mlp)  # evicted: the slot now holds another adapter
        runner.set_lora_slot(1, attn)  # and it comes back in another slot
        got_mlp, got_attn = prompt_logits(runner, ids, 0), prompt_logits(runner, ids, 1)
        runner.set_lora_slot(1, None)  # emptied: the base model
        got_base = prompt_logits(runner, ids, 1)
    assert compiles == []
    np.testing.assert_allclose(got_mlp, teacher_forced_logits(made["mlp"][1], ids), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got_attn, teacher_forced_logits(made["attn"][1], ids), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got_base, teacher_forced_logits(base, ids), atol=1e-4, rtol=0)


def test_adapters_that_cannot_be_served_are_refused_in_one_line(adapters, tmp_path):
    import json

    base_dir, _, made = adapters
    runner = _runner(base_dir)
    spec = runner.adapter_spec
    with pytest.raises(ValueError, match="rank 16 is greater than max_lora_rank 8"):
        read_adapter(made["all"][0], dataclasses.replace(spec, max_rank=8))
    with pytest.raises(ValueError, match="not a PEFT LoRA adapter"):
        read_adapter(str(tmp_path), spec)
    bias = tmp_path / "bias"
    bias.mkdir()
    src = made["attn"][0]
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (bias / f).write_bytes(open(f"{src}/{f}", "rb").read())
    cfg = json.loads((bias / "adapter_config.json").read_text())
    cfg["bias"] = "lora_only"
    (bias / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="retrain the base model's biases") as err:
        read_adapter(str(bias), spec)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def lora_llm(adapters):
    from jaxserve import LLM

    return LLM(adapters[0], enable_lora=True, max_loras=2, max_lora_rank=16, **engine_kwargs())


def test_offline_generation_serves_each_prompt_with_its_adapter(adapters, lora_llm):
    """Three adapters and the base model in one generate call, with two slots: the third adapter
    waits for a slot to free; every greedy token is peft's with the prompt's adapter; the prefix
    cache reuses pages within one adapter and never across adapters."""
    from reference_checks import check_greedy

    from jaxserve import SamplingParams
    from jaxserve.lora.request import LoRARequest

    _, base, made = adapters
    llm = lora_llm
    names = sorted(made)
    requests = {name: LoRARequest(name, i + 1, made[name][0]) for i, name in enumerate(names)}
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, 500, size=30).tolist()  # the same prompt for all: pages must not mix
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    loras = [requests[n] for n in names] + [None, requests[names[0]]]
    outs = llm.generate(
        [{"prompt_token_ids": prompt}] * len(loras), params, use_tqdm=False, lora_request=loras
    )
    models = [made[n][1] for n in names] + [base, made[names[0]][1]]
    for out, model in zip(outs, models):
        compared, total = check_greedy(model, prompt, out.outputs[0].token_ids)
        assert total == 12 and compared >= 10
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:4]}) == 4  # each adapter its own text
    # the same prompt again with the first adapter finds its pages; with another adapter it does not
    again = llm.generate(
        [{"prompt_token_ids": prompt}] * 2,
        params,
        use_tqdm=False,
        lora_request=[requests[names[0]], requests[names[1]]],
    )
    assert again[0].num_cached_tokens > 0 and again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert again[1].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_bad_lora_requests_are_refused_without_harm(adapters, tmp_path):
    from jaxserve import LLM, SamplingParams
    from jaxserve.lora.request import LoRARequest

    base_dir, _, made = adapters
    params = SamplingParams(max_tokens=2)
    plain = LLM(base_dir, **engine_kwargs())
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate([[5, 6]], params, use_tqdm=False, lora_request=LoRARequest("a", 1, made["attn"][0]))
    llm = LLM(base_dir, enable_lora=True, max_lora_rank=8, **engine_kwargs())
    with pytest.raises(ValueError, match="greater than max_lora_rank 8"):
        llm.generate([[5, 6]], params, use_tqdm=False, lora_request=LoRARequest("all", 1, made["all"][0]))
    with pytest.raises(ValueError, match="not a PEFT LoRA adapter"):
        llm.generate([[5, 6]], params, use_tqdm=False, lora_request=LoRARequest("none", 2, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("zero", 0, made["attn"][0])
    assert llm.generate([[5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids  # the engine goes on


def test_engine_compiles_nothing_after_startup_as_adapters_come_and_go(adapters):
    """Two slots, three adapters and the base model, batches that load, evict and mix them:
    after start-up's compiles, nothing compiles (the step programs and the slot writer)."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.lora.request import LoRARequest

    base_dir, _, made = adapters
    kwargs = engine_kwargs(enforce_eager=False, max_num_batched_tokens=32, max_num_seqs=4)
    llm = LLM(base_dir, enable_lora=True, max_loras=2, max_lora_rank=16, **kwargs)
    runner = llm.llm_engine.runner
    compiled_at_start = runner.num_compiled
    assert compiled_at_start == len(runner.buckets.all())
    a, b, c = (LoRARequest(name, i + 1, made[name][0]) for i, name in enumerate(sorted(made)))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with compilations() as compiles:
        for batch in ([a], [b, None, c], [c, a, b, None], [None], [b]):
            prompts = [{"prompt_token_ids": [5 + i, 9, 33, 2 + i]} for i in range(len(batch))]
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=batch)
            assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert compiles == []
    assert runner.num_compiled == compiled_at_start


def test_beam_search_with_an_adapter_matches_peft(adapters, lora_llm):
    from reference_checks import hf_beams

    from jaxserve import BeamSearchParams
    from jaxserve.lora.request import LoRARequest

    _, _, made = adapters
    prompt = [7, 300, 41, 12, 99, 5]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    lora = LoRARequest("mlp-beams", 50, made["mlp"][0])
    (ours,) = lora_llm.beam_search({"prompt_token_ids": prompt}, params, lora_request=lora)
    want_seqs, want_scores = hf_beams(made["mlp"][1], prompt, 3, 6, 1.0, eos=None)
    assert [s.tokens[len(prompt) :] for s in ours.sequences] == want_seqs
    np.testing.assert_allclose([s.score for s in ours.sequences], want_scores, atol=1e-4)
