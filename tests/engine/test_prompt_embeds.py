"""Prompts given as embeddings (`--enable-prompt-embeds`): the rows a token prompt's embedding
lookup gives produce that prompt's tokens, random rows the tokens transformers generates from the
same inputs_embeds (the families where more than a lookup makes them: Gemma scales in its embedding, OPT's
projection in and learned positions, GPT-2's positions), mixed in one batch with token prompts,
chunked and preempted; distinct embeddings never share cached pages, identical ones do; bad
tensors are refused with a clear error and leave the engine serving."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import engine_kwargs, make_checkpoint, make_family_checkpoint

from jaxserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
OPT_POST_LN = (
    "OPTConfig",
    "OPTForCausalLM",
    {"ffn_dim": 128, "do_layer_norm_before": False, "word_embed_proj_dim": 32},
)
GPT2 = (
    "GPT2Config",
    "GPT2LMHeadModel",
    {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "n_inner": 128},
)


@pytest.fixture(scope="module")
def llama(tiny_llama_gqa):
    """(LLM taking prompt embeddings, torch model) on the tiny Llama."""
    path, model = tiny_llama_gqa
    return LLM(path, enable_prompt_embeds=True, **engine_kwargs()), model


def table(model) -> np.ndarray:
    return model.get_input_embeddings().weight.detach().numpy()


def random_rows(model, n: int, seed: int) -> np.ndarray:
    """n rows scaled like the model's embedding table's, but none of them."""
    rows = np.random.default_rng(seed).standard_normal((n, table(model).shape[1]))
    return (rows * table(model).std()).astype(np.float32)


def hf_greedy(model, embeds: np.ndarray, n: int) -> list[int]:
    out = model.generate(
        inputs_embeds=torch.from_numpy(embeds)[None], max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, -n:].tolist()


def test_a_token_prompts_embeddings_give_its_tokens_in_a_mixed_batch(llama):
    """Greedy and seeded sampling; one prompt longer than the step's budget (64), so its
    embeddings arrive over two steps; token prompts in the same batch are unaffected."""
    llm, model = llama
    prompts = [[5, 9, 17, 33, 2, 8, 100, 7], list(range(3, 90)), [44] * 3]
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    for params in (GREEDY, seeded):
        tokens = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        mixed = [{"prompt_embeds": table(model)[p]} for p in prompts] + [
            {"prompt_token_ids": p} for p in prompts
        ]
        outs = llm.generate(mixed, params, use_tqdm=False)
        for i, want in enumerate(tokens):
            assert outs[i].outputs[0].token_ids == want.outputs[0].token_ids
            assert outs[i].prompt_token_ids is None and outs[i].prompt is None
            assert outs[i + len(prompts)].outputs[0].token_ids == want.outputs[0].token_ids
        assert outs[0].outputs[0].text == tokens[0].outputs[0].text  # detokenized without the placeholders


@pytest.mark.parametrize("family", ["llama", "gemma", "opt_post_ln", "gpt2"])
def test_random_embeddings_generate_what_transformers_generates(family, tiny_llama_gqa, tmp_path):
    if family == "llama":
        path, model = tiny_llama_gqa
    elif family == "gemma":
        path, model = str(tmp_path), make_family_checkpoint(tmp_path, "gemma")
    else:
        path, model = (
            str(tmp_path),
            make_checkpoint(tmp_path, *(OPT_POST_LN if family != "gpt2" else GPT2), "float32", 0),
        )
    kw = {"max_model_len": 256} if family == "gpt2" else {}
    llm = LLM(path, enable_prompt_embeds=True, **engine_kwargs(**kw))
    embeds = [random_rows(model, n, seed) for seed, n in enumerate((6, 19, 70))]
    outs = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
    for e, out in zip(embeds, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, e, GREEDY.max_tokens)


def test_distinct_embeddings_never_share_cached_pages_identical_ones_do(llama):
    """Two prompts of different embeddings have the same placeholder token ids; the second must
    not be served the first's KV (prefix caching is on). The same embeddings again hit the cache."""
    llm, model = llama
    a, b = random_rows(model, 40, 10), random_rows(model, 40, 11)
    first, second = (llm.generate([{"prompt_embeds": e}], GREEDY, use_tqdm=False)[0] for e in (a, b))
    assert second.num_cached_tokens == 0
    assert second.outputs[0].token_ids == hf_greedy(model, b, GREEDY.max_tokens)
    assert first.outputs[0].token_ids != second.outputs[0].token_ids
    again = llm.generate([{"prompt_embeds": a}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # a token prompt of the placeholder ids does not hit the embeddings' pages either
    zeros = llm.generate([{"prompt_token_ids": [0] * 40}], GREEDY, use_tqdm=False)[0]
    assert zeros.num_cached_tokens == 0


def test_preempted_embeddings_requests_are_recomputed_exactly(tiny_llama_gqa):
    """A pool of 12 pages of 8 for four requests that grow to 60 tokens each: requests are
    preempted and recomputed (the prompt from its embeddings, the output from its tokens)."""
    path, model = tiny_llama_gqa
    llm = LLM(
        path,
        enable_prompt_embeds=True,
        **engine_kwargs(num_gpu_blocks_override=13, enable_prefix_caching=False),
    )
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    embeds = [random_rows(model, 30, 20 + i) for i in range(4)]
    outs = llm.generate([{"prompt_embeds": e} for e in embeds], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for e, out in zip(embeds, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, e, params.max_tokens)


@pytest.mark.parametrize(
    "embeds,message",
    [
        (np.zeros((4, 7), np.float32), "hidden size"),
        (np.zeros(64, np.float32), "sequence_length, hidden_size"),
        (np.zeros((2, 4, 64), np.float32), "sequence_length, hidden_size"),
        (np.zeros((4, 64), np.int32), "floats"),
        (np.zeros((0, 64), np.float32), "empty"),
        (np.full((4, 64), np.nan, np.float32), "not finite"),
        (np.zeros((600, 64), np.float32), "maximum context length"),
    ],
)
def test_bad_embeddings_are_refused_and_the_engine_serves_on(llama, embeds, message):
    llm, model = llama
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_embeds": embeds}], GREEDY, use_tqdm=False)
    out = llm.generate([{"prompt_embeds": table(model)[[5, 9, 17]]}], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_prompt_logprobs_need_token_ids_and_the_flag_is_required(llama, tiny_llama_gqa):
    llm, model = llama
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate(
            [{"prompt_embeds": table(model)[[5, 9]]}], SamplingParams(prompt_logprobs=1), use_tqdm=False
        )
    plain = LLM(tiny_llama_gqa[0], **engine_kwargs())
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        plain.generate([{"prompt_embeds": table(model)[[5, 9]]}], GREEDY, use_tqdm=False)


def test_n_samples_and_ngram_proposals_over_embeddings(llama, tiny_llama_gqa):
    """n = 2 seeded samples share the embeddings' prompt pages and draw what a token prompt's do;
    an engine proposing n-grams (its prompts' ids are placeholders, so proposals come from the
    output alone) keeps exactly the tokens of the plain one."""
    llm, model = llama
    prompts = [[5, 9, 17, 5, 9, 17, 5, 9], list(range(3, 30))]
    two = SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=3)
    want = llm.generate([{"prompt_token_ids": p} for p in prompts], two, use_tqdm=False)
    got = llm.generate([{"prompt_embeds": table(model)[p]} for p in prompts], two, use_tqdm=False)
    for w, g in zip(want, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    spec = LLM(tiny_llama_gqa[0], enable_prompt_embeds=True, speculative_config=ngram, **engine_kwargs())
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = llm.generate([{"prompt_token_ids": p} for p in prompts], long, use_tqdm=False)
    got = spec.generate([{"prompt_embeds": table(model)[p]} for p in prompts], long, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.llm_engine.scheduler.spec_stats.num_draft_tokens > 0


def test_structured_outputs_over_embeddings(llama):
    """A constrained request runs its forward pass and its masked sampling as two programs: the
    forward one takes the embeddings too."""
    from jaxserve.sampling_params import StructuredOutputsParams

    llm, model = llama
    params = SamplingParams(
        max_tokens=12, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[a-z ]{12}")
    )
    prompts = [[5, 9, 17, 33, 2, 8], list(range(40, 60))]
    want = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = llm.generate([{"prompt_embeds": table(model)[p]} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
