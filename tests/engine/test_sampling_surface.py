"""The sampling surface beyond temperature/top-k/top-p, end to end on a tiny Llama against
transformers (float32) and against the definitions: logprobs and prompt logprobs are
transformers' log_softmax; repetition penalty and bad words give transformers' greedy
tokens under its own logits processors; presence/frequency penalties, logit bias and
allowed tokens choose what their definitions choose from transformers' logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference_checks import NEAR_TIE, compilations, teacher_forced_logits
from tiny_models import engine_kwargs

from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_gqa):
    return LLM(tiny_llama_gqa[0], **engine_kwargs())


@pytest.fixture(scope="module")
def model(tiny_llama_gqa):
    return tiny_llama_gqa[1]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(3, 500, size=n).tolist() for n in (5, 23, 40)]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.as_tensor(logits, dtype=torch.float64), -1).numpy()


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_transformers_log_softmax(llm, model, prompts, temperature):
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=12, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, _generate(llm, prompts, params)):
        ref = log_softmax(teacher_forced_logits(model, prompt + out.token_ids))
        total = 0.0
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + i]
            order = np.argsort(-row, kind="stable")
            assert next(iter(entry)) == token  # the sampled token comes first
            assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
            assert entry[token].rank == 1 + int(np.sum(row > row[token] + 1e-6))
            top = [
                t for t, lp in entry.items() if lp.rank <= 5 and (t != token or lp.rank == entry[token].rank)
            ]
            assert sorted(top, key=lambda t: entry[t].rank)[:5] == order[:5].tolist() or np.any(
                np.diff(np.sort(row)[::-1][:6]) > -1e-4  # a near tie may swap neighbours
            )
            for t, lp in entry.items():
                assert lp.logprob == pytest.approx(row[t], abs=1e-4)
            total += row[token]
        assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)
        assert len(out.logprobs) == len(out.token_ids)


def test_prompt_logprobs_at_every_position_across_prefill_chunks(tiny_llama_gqa, model):
    """A 150-token prompt prefilled in chunks of at most 64: every position's logprob, even
    where the next token lies in the next chunk; asked twice, with the prefix cache warm."""
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs(max_model_len=256))
    prompt = np.random.default_rng(5).integers(3, 500, size=150).tolist()
    ref = log_softmax(teacher_forced_logits(model, prompt))
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    for _ in range(2):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry, row = out.prompt_logprobs[pos], ref[pos - 1]
            token = prompt[pos]
            assert next(iter(entry)) == token
            assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
            assert entry[token].rank == 1 + int(np.sum(row > row[token] + 1e-6))
            assert len(entry) in (3, 4)  # the prompt token, plus the top 3 unless it is one of them
            for t, lp in entry.items():
                assert lp.logprob == pytest.approx(row[t], abs=1e-4)


def _hf_greedy(model, prompt, max_new_tokens, **processors) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,  # no early stop (ours ignores EOS) ...
            suppress_tokens=None,
            pad_token_id=0,
            **processors,
        )
    return out[0, len(prompt) :].tolist()


def test_repetition_penalty_gives_transformers_greedy_tokens(llm, model, prompts):
    plain = _generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8)
    ours = _generate(llm, prompts, params)
    eos = model.config.eos_token_id
    for prompt, out in zip(prompts, ours):
        # min_new_tokens keeps transformers going but masks EOS; compare where that cannot matter
        want = _hf_greedy(model, prompt, 24, repetition_penalty=1.8)
        n = next((i for i, t in enumerate(out.token_ids) if t == eos), len(want))
        assert out.token_ids[:n] == want[:n]
    assert [o.token_ids for o in ours] != [b.token_ids for b in plain]  # the penalty bites


def test_bad_words_give_transformers_greedy_tokens(llm, model, prompts):
    """Bad words given as text: single-token ones are never produced, a multi-token one never
    completed; transformers, given the same token ids, must choose the same tokens."""
    engine = llm.llm_engine
    tok = engine.tokenizer
    plain = _generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))

    # Words the plain outputs produce (so that banning them changes something) and whose
    # text encodes back to the same tokens: one of one token, one of two.
    def round_trips(ids):
        text = tok.decode(ids)
        return text == text.strip() and tok.encode(text, add_special_tokens=False) == ids

    outs = [o.token_ids for o in plain]
    single = next(t for o in outs for t in o[1:] if round_trips([t]))
    pair = next(o[i : i + 2] for o in outs for i in range(1, len(o) - 1) if round_trips(o[i : i + 2]))
    words = [tok.decode([single]), tok.decode(pair)]
    ids = engine.input_processor.bad_words_token_ids(words)
    assert [single] in ids and pair in ids
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, bad_words=words)
    ours = _generate(llm, prompts, params)
    for prompt, out in zip(prompts, ours):
        for word in ids:  # vLLM checks the output only, transformers the prompt too: keep them apart
            assert len(word) == 1 or tuple(prompt[-(len(word) - 1) :]) != tuple(word[:-1])
        want = _hf_greedy(model, prompt, 20, bad_words_ids=ids)
        eos = model.config.eos_token_id
        n = next((i for i, t in enumerate(out.token_ids) if t == eos), len(want))
        assert out.token_ids[:n] == want[:n]
        for word in ids:
            text = out.token_ids
            assert not any(tuple(text[i : i + len(word)]) == tuple(word) for i in range(len(text)))
    assert [o.token_ids for o in ours] != [p.token_ids for p in plain]


def test_penalties_bias_and_allowed_tokens_choose_as_defined(llm, model, prompts):
    """Each greedy step is the argmax of transformers' logits processed by the definitions:
    the bias row (logit_bias; -inf outside allowed_token_ids), then repetition over prompt
    and output tokens, frequency and presence over output tokens."""
    allowed = list(range(3, 300))
    bias = {7: 3.0, 11: -2.0, 250: 1.5}
    params = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        ignore_eos=True,
        presence_penalty=0.8,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        logit_bias=bias,
        allowed_token_ids=allowed,
    )
    ours = _generate(llm, prompts, params)
    compared = 0
    for prompt, out in zip(prompts, ours):
        raw = teacher_forced_logits(model, prompt + out.token_ids).astype(np.float64)
        for i, token in enumerate(out.token_ids):
            logits = np.full(raw.shape[1], -np.inf)
            logits[allowed] = raw[len(prompt) - 1 + i, allowed]
            for t, b in bias.items():
                logits[t] += b
            counts = np.bincount(out.token_ids[:i], minlength=raw.shape[1])
            seen = counts > 0
            seen[prompt] = True
            logits = np.where(seen, np.where(logits > 0, logits / 1.3, logits * 1.3), logits)
            logits -= 0.4 * counts + 0.8 * (counts > 0)
            top2 = np.sort(logits)[-2:]
            if top2[1] - top2[0] < NEAR_TIE:
                continue
            assert token == int(np.argmax(logits)), f"step {i}"
            compared += 1
        assert set(out.token_ids) <= set(allowed)
    assert compared >= 60


def test_logit_bias_forces_and_bans(llm, prompts):
    forced = _generate(
        llm, prompts[:1], SamplingParams(temperature=1.0, seed=1, max_tokens=6, logit_bias={42: 100.0})
    )
    assert forced[0].token_ids == [42] * 6
    plain = _generate(llm, prompts[:1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    first = plain.token_ids[0]
    banned = _generate(
        llm,
        prompts[:1],
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={first: -100.0}),
    )[0]
    assert first not in banned.token_ids


def test_over_max_logprobs_and_bad_ids_are_refused(llm, prompts):
    p = {"prompt_token_ids": prompts[0]}
    with pytest.raises(ValueError, match="prompt logprobs of 25, which is greater than max allowed: 20"):
        llm.generate(p, SamplingParams(prompt_logprobs=25), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids has token ids outside the vocabulary"):
        llm.generate(p, SamplingParams(allowed_token_ids=[1, 5000]), use_tqdm=False)
    assert _generate(llm, prompts[:1], SamplingParams(max_tokens=2))[0].token_ids  # still serving


def test_mixed_batches_compile_nothing_after_warm_up(tiny_llama_gqa, prompts):
    """One workload mixing every setting warms up the step variants it needs; the same
    workload with other values in every field (and other seeds) then compiles nothing."""
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs(max_num_batched_tokens=32, max_num_seqs=4))

    def workload(scale: float, seed: int):
        kinds = [
            dict(temperature=0.0, presence_penalty=0.5 * scale, frequency_penalty=0.2 * scale),
            dict(temperature=0.8, top_p=0.5 + 0.2 * scale, seed=seed, logprobs=int(2 * scale)),
            dict(temperature=1.0, top_k=int(3 * scale), min_p=0.05, repetition_penalty=1.0 + scale / 3),
            dict(temperature=0.5, logit_bias={int(10 * scale): scale}, bad_words=["the"], min_tokens=2),
            dict(temperature=1.0, allowed_token_ids=list(range(3, int(100 * scale))), prompt_logprobs=1),
        ]
        params = [SamplingParams(max_tokens=6, ignore_eos=True, **k) for k in kinds]
        batch = [prompts[i % len(prompts)] for i in range(len(params))]
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)

    workload(1.0, seed=1)
    with compilations() as compiles:
        workload(2.0, seed=2)
    assert compiles == []
