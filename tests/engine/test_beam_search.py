"""LLM.beam_search against transformers' generate(num_beams=...) on a tiny Llama (float32):
the same sequences in the same order with the same scores, for beam widths 2 and 4, with
and without a length penalty, and with beams that end at EOS."""

from __future__ import annotations

import numpy as np
import pytest
from reference_checks import hf_beams
from tiny_models import engine_kwargs

from jaxserve import LLM, BeamSearchParams, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_gqa):
    return LLM(tiny_llama_gqa[0], **engine_kwargs())


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(4)
    return [rng.integers(3, 500, size=n).tolist() for n in (6, 19)]


def _check(ours, prompt, want_seqs, want_scores):
    got = [s.tokens[len(prompt) :] for s in ours.sequences]
    assert got == want_seqs
    np.testing.assert_allclose([s.score for s in ours.sequences], want_scores, atol=1e-4)
    assert all(s.tokens[: len(prompt)] == prompt for s in ours.sequences)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.6])
def test_beams_match_transformers(llm, tiny_llama_gqa, prompts, width, length_penalty):
    model = tiny_llama_gqa[1]
    params = BeamSearchParams(beam_width=width, max_tokens=7, ignore_eos=True, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, ours in zip(prompts, outs):
        assert len(ours.sequences) == width
        _check(ours, prompt, *hf_beams(model, prompt, width, 7, length_penalty, eos=None))
        for s in ours.sequences:
            assert s.cum_logprob == pytest.approx(
                sum(d[t].logprob for d, t in zip(s.logprobs, s.tokens[len(prompt) :]))
            )
            assert s.finish_reason == "length" and s.text is not None


@pytest.mark.parametrize("width", [2, 4])
def test_beams_ending_at_eos_match_transformers(llm, tiny_llama_gqa, prompts, width):
    """With an EOS the beams often choose, finished beams compete with running ones by their
    length-normalised scores, and the search may stop before max_tokens."""
    model = tiny_llama_gqa[1]
    engine = llm.llm_engine
    prompt = prompts[0]
    # an EOS among the likely next tokens after a couple of steps
    greedy = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )[0]
    eos = greedy.outputs[0].token_ids[2]
    saved = engine.input_processor.eos_token_id
    engine.input_processor.eos_token_id = eos
    try:
        ours = llm.beam_search(
            {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=width, max_tokens=8)
        )[0]
    finally:
        engine.input_processor.eos_token_id = saved
    want_seqs, want_scores = hf_beams(model, prompt, width, 8, 1.0, eos=eos)
    _check(ours, prompt, want_seqs, want_scores)
    assert any(s.finish_reason == "stop" and s.tokens[-1] == eos for s in ours.sequences)


def test_beam_width_beyond_max_logprobs_is_refused(llm, prompts):
    with pytest.raises(ValueError, match="--max-logprobs is 20"):
        llm.beam_search({"prompt_token_ids": prompts[0]}, BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=2)
