"""The whole engine on a tiny Llama: scheduling choices (prefix caching, preemption,
chunked prefill, batching) must never change greedy outputs, seeded sampling must not
depend on the batch, and a mixed workload after start-up compiles nothing."""

from __future__ import annotations

import numpy as np
import pytest
from reference_checks import compilations
from tiny_models import engine_kwargs

from jaxserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 500, size=20).tolist()  # a common prefix exercises the prefix cache
    return [shared + rng.integers(3, 500, size=n).tolist() for n in (3, 11, 30)] + [
        rng.integers(3, 500, size=n).tolist() for n in (2, 50)
    ]


def _generate(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(tiny_llama_gqa, prompts):
    """Each prompt alone, prefix caching off, a roomy pool: the plainest schedule."""
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs(enable_prefix_caching=False))
    return [_generate(llm, [p])[0] for p in prompts]


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # batched, prefix caching on
        {"enable_prefix_caching": False},
        {"num_gpu_blocks_override": 12, "max_num_seqs": 4},  # forces preemption
        {"max_num_batched_tokens": 16, "max_num_seqs": 4},  # forces chunked prefill
        # preempted and queued requests held back while others run (scheduler_delay_factor)
        {"num_gpu_blocks_override": 12, "max_num_seqs": 2, "scheduler_delay_factor": 2.0},
    ],
    ids=["batched", "no-prefix-cache", "preemption", "chunked-prefill", "delayed-prompts"],
)
def test_schedules_do_not_change_greedy_outputs(tiny_llama_gqa, prompts, baseline, overrides):
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs(**overrides))
    assert _generate(llm, prompts) == baseline
    sched = llm.llm_engine.scheduler
    if "num_gpu_blocks_override" in overrides and "scheduler_delay_factor" not in overrides:
        assert sched.num_preemptions > 0
    if overrides == {}:
        # Requests admitted together cannot hit each other's pages; a second round does.
        assert _generate(llm, prompts) == baseline
        assert sched.prefix_cache_stats.hits > 0
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks  # every page back in the pool


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llama_gqa, prompts):
    """Alone, or among 16 requests with every other kind of setting (so in another row and
    another processor slot), a seeded request samples the same tokens."""
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs())
    seeded = SamplingParams(
        temperature=1.0,
        top_p=0.9,
        top_k=50,
        seed=1234,
        max_tokens=10,
        ignore_eos=True,
        repetition_penalty=1.2,
        logprobs=2,
    )
    alone = _generate(llm, [prompts[0]], seeded)[0]
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.3, min_p=0.1),
        dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5),
        dict(temperature=0.9, logit_bias={9: 2.0, 33: -5.0}),
        dict(temperature=1.0, allowed_token_ids=list(range(3, 200))),
        dict(temperature=0.0, repetition_penalty=1.5, logprobs=5),
        dict(temperature=1.0, prompt_logprobs=2, seed=7),
    ]
    others = [SamplingParams(max_tokens=8, ignore_eos=True, **kinds[i % len(kinds)]) for i in range(16)]
    batch = [prompts[i % len(prompts)] for i in range(1, 17)] + [prompts[0]]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], others + [seeded], use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == alone
    other_seed = _generate(llm, [prompts[0]], seeded.clone(seed=99))[0]
    assert other_seed != alone


def test_n_samples_differ_and_share_the_prompt(tiny_llama_gqa, prompts):
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs())
    out = llm.generate(
        {"prompt_token_ids": prompts[1]},
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    for c in out.outputs:  # logprobs=0: just the sampled token's, summed into the cumulative one
        assert [list(d) for d in c.logprobs] == [[t] for t in c.token_ids]
        chosen = sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids))
        assert c.cumulative_logprob == pytest.approx(chosen) and c.cumulative_logprob < 0


def test_n_samples_take_the_first_samples_prompt_pages_from_the_cache(tiny_llama_gqa, prompts):
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs())
    stats = llm.llm_engine.scheduler.prefix_cache_stats
    prompt = prompts[4]  # 50 tokens: 6 full pages of 8 before the last token
    before = stats.hits
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    assert stats.hits - before == 3 * 6 * 8  # samples 2..4 computed only the partial page


def test_best_of_returns_the_n_most_likely_samples(tiny_llama_gqa, prompts):
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs())
    kw = dict(temperature=1.0, seed=21, max_tokens=6, ignore_eos=True, logprobs=0)
    every = llm.generate({"prompt_token_ids": prompts[2]}, SamplingParams(n=4, **kw), use_tqdm=False)[0]
    best = llm.generate(
        {"prompt_token_ids": prompts[2]}, SamplingParams(n=2, best_of=4, **kw), use_tqdm=False
    )[0]
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    with pytest.raises(ValueError, match="best_of must be 1 when using greedy"):
        SamplingParams(temperature=0.0, best_of=2)


def test_stop_strings_and_stop_tokens(tiny_llama_gqa, prompts):
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs())
    free = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)[0].outputs[0]
    text, ids = free.text, free.token_ids
    assert text
    stop_id = ids[4]
    by_id = llm.generate(
        {"prompt_token_ids": prompts[0]}, GREEDY.clone(stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert by_id.token_ids == ids[: ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    by_str = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY.clone(stop=[stop]), use_tqdm=False)[0]
    assert by_str.outputs[0].text == text[: text.index(stop)]
    assert by_str.outputs[0].finish_reason == "stop" and by_str.outputs[0].stop_reason == stop
    assert (
        llm.llm_engine.scheduler.block_manager.num_free_blocks
        == llm.llm_engine.scheduler.block_manager.num_usable_blocks
    )
    # A stop string completed by the last token max_tokens allows is a stop, not a length
    # finish (vLLM's rule). The stop string: the text of the first n tokens but its first
    # character, for the first n >= 3 whose last token adds text and whose string no shorter
    # output holds.
    tok = llm.get_tokenizer()
    for n in range(3, len(ids) + 1):
        head, before = tok.decode(ids[:n]), tok.decode(ids[: n - 1])
        stop = head[1:]
        if len(head) > len(before) and stop not in before:
            break
    else:
        pytest.fail(f"no token ends a fresh string: {tok.decode(ids)!r}")
    last = llm.generate(
        {"prompt_token_ids": prompts[0]}, GREEDY.clone(max_tokens=n, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert last.token_ids == ids[:n] and last.text == head[: -len(stop)]
    assert last.finish_reason == "stop" and last.stop_reason == stop


def test_min_tokens_masks_stop_tokens(tiny_llama_gqa, prompts):
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs())
    free = _generate(llm, [prompts[2]])[0]
    stop_id = free[0]
    params = GREEDY.clone(stop_token_ids=[stop_id], min_tokens=4, max_tokens=12)
    out = llm.generate({"prompt_token_ids": prompts[2]}, params, use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:4]
    assert len(out.token_ids) >= 4
    assert out.finish_reason == "length" or out.token_ids[-1] == stop_id


@pytest.mark.parametrize("quantization, kv_cache_dtype", [(None, "auto"), ("int8", "int8")])
def test_mixed_workload_compiles_nothing_after_startup(tiny_llama_gqa, prompts, quantization, kv_cache_dtype):
    kwargs = engine_kwargs(enforce_eager=False, max_num_batched_tokens=32, max_num_seqs=4)
    llm = LLM(tiny_llama_gqa[0], quantization=quantization, kv_cache_dtype=kv_cache_dtype, **kwargs)
    runner = llm.llm_engine.runner
    compiled_at_start = runner.num_compiled
    assert compiled_at_start == len(runner.buckets.all())
    with compilations() as compiles:
        params = [
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.5, max_tokens=9, seed=3, ignore_eos=True),
            SamplingParams(temperature=1.0, top_k=3, min_p=0.05, max_tokens=3, ignore_eos=True),
        ]
        for batch in ([prompts[0]], prompts[:3], prompts, prompts[3:]):
            llm.generate(
                [{"prompt_token_ids": p} for p in batch],
                [params[i % 3] for i in range(len(batch))],
                use_tqdm=False,
            )
    assert compiles == []
    assert runner.num_compiled == compiled_at_start


def test_bad_requests_are_refused_without_harm(tiny_llama_gqa, prompts):
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs())
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        llm.generate({"prompt_token_ids": [5] * 300}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs of 21, which is greater than max allowed: 20"):
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(
        ValueError, match=r"logit_bias has token ids outside the vocabulary \[0, 512\): \[512\]"
    ):
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(logit_bias={512: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(allowed_token_ids=[]), use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate({"prompt_token_ids": [10**6]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert not llm.llm_engine.has_unfinished_requests()
    assert _generate(llm, [prompts[0]])[0]  # the engine still serves


def test_invalid_engine_arguments_name_the_argument(tiny_llama_gqa):
    from jaxserve.args import EngineArgs

    for kwargs, name in [
        ({"block_size": 7}, "block_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_model_len": 10**6}, "max_model_len"),
        ({"dtype": "int3"}, "dtype"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"no_such_arg": 1}, "no_such_arg"),
    ]:
        with pytest.raises(ValueError, match=name):
            LLM(tiny_llama_gqa[0], **{**engine_kwargs(), **kwargs})
    assert (
        EngineArgs(model=tiny_llama_gqa[0], max_model_len="0.2k")
        .create_engine_config()
        .model_config.max_model_len
        == 200
    )


def test_generation_config_sets_request_defaults(tmp_path):
    import json

    from tiny_models import make_llama_checkpoint

    make_llama_checkpoint(tmp_path, "gqa")
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen.update(
        {
            "temperature": 0.3,
            "top_k": 7,
            "max_new_tokens": 5,
            "eos_token_id": [2, 9],
            "repetition_penalty": 1.15,
        }
    )
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(tmp_path), **engine_kwargs(override_generation_config={"top_k": 3}))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.3, 3, 5)
    assert defaults.repetition_penalty == 1.15
    assert llm.llm_engine.input_processor.extra_eos_ids == {9}
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5
    plain = LLM(str(tmp_path), **engine_kwargs(generation_config="vllm")).get_default_sampling_params()
    assert (plain.temperature, plain.top_k, plain.max_tokens, plain.repetition_penalty) == (1.0, 0, 16, 1.0)


def _everything(output) -> tuple[list, list]:
    """All a RequestOutput says about its completions: (what must be equal, the logprobs). The
    logprobs are compared to float32 rounding: a step's variant follows its batch (a row with
    top logprobs, a constrained row), and a request's batch-mates change when another request's
    stop is seen a step later."""
    exact = [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in output.outputs]
    lps = [c.cumulative_logprob for c in output.outputs if c.cumulative_logprob is not None]
    for c in output.outputs:
        lps += [lp.logprob for step in c.logprobs or () for lp in step.values()]
    lps += [lp.logprob for step in output.prompt_logprobs or () if step for lp in step.values()]
    return exact, lps


@pytest.mark.parametrize(
    "overrides",
    [{"num_gpu_blocks_override": 12, "max_num_seqs": 4}, {"max_num_batched_tokens": 16, "max_num_seqs": 4}],
    ids=["preemption", "chunked-prefill"],
)
@pytest.mark.both_schedulings
def test_asynchronous_scheduling_changes_no_output(tiny_llama_gqa, prompts, overrides):
    """One engine, the same mixed requests with async scheduling off, then on: every token, text,
    finish and stop reason is the same, and every logprob to float32 rounding; greedy and seeded, n and best_of,
    penalties, logprobs and prompt logprobs, stops, and the requests that make a step wait for
    its tokens (bad words, a grammar)."""
    from jaxserve.sampling_params import StructuredOutputsParams

    llm = LLM(tiny_llama_gqa[0], **engine_kwargs(**overrides))
    free = _generate(llm, [prompts[0]])[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
    params = [
        GREEDY,
        seeded.clone(n=3, logprobs=3),
        seeded.clone(n=2, best_of=3, seed=5),
        seeded.clone(
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
            min_tokens=4,
            logit_bias={7: 2.0},
            prompt_logprobs=2,
        ),  # fmt: skip
        GREEDY.clone(stop_token_ids=[free[5]], ignore_eos=False),
        GREEDY.clone(stop=[llm.get_tokenizer().decode(free[3:5])]),
        seeded.clone(bad_words=[llm.get_tokenizer().decode(free[:2])]),
        GREEDY.clone(
            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta gamma"]), max_tokens=8
        ),
    ]
    requests = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(len(params))]
    engine = llm.llm_engine
    results = {}
    for mode in (False, True):
        engine.async_scheduling = mode
        results[mode] = [_everything(o) for o in llm.generate(requests, params, use_tqdm=False)]
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_usable_blocks and not engine.has_unfinished_requests()
    for (exact, lps), (exact_sync, lps_sync) in zip(results[True], results[False], strict=True):
        assert exact == exact_sync
        np.testing.assert_allclose(lps, lps_sync, rtol=1e-5, atol=1e-5)
    if "num_gpu_blocks_override" in overrides:
        assert engine.scheduler.num_preemptions > 0
