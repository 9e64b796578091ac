"""benchmarks/speculative.py's parts on a tiny model: the token check passes for exact
configurations (and names the first prompt that differs otherwise), and a decode rate comes with
the tokens and the acceptance length."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark
from tiny_models import engine_kwargs

from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llms(tiny_llama_gqa):
    kw = engine_kwargs(max_model_len=128)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    return {
        "none": LLM(tiny_llama_gqa[0], **kw),
        "ngram": LLM(tiny_llama_gqa[0], speculative_config=spec, **kw),
    }


def test_token_check_and_decode_rate(llms):
    bench = load_benchmark("speculative")
    llms["none"].get_tokenizer().chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert bench.check_same_tokens(llms, 6, 8) == {"greedy": 6, "temperature 0.01, top-k 5, seeded": 6}
    prompts = bench._prompts(llms["none"], "random", 2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    rate, tokens, length = bench._decode_rate(llms["ngram"], prompts, params)
    assert rate > 0 and [len(t) for t in tokens] == [12, 12] and length >= 1.0
    assert bench._decode_rate(llms["none"], prompts, params)[1] == tokens


def test_token_check_names_a_difference(llms, monkeypatch):
    bench = load_benchmark("speculative")
    real = llms["ngram"].generate

    def one_token_off(prompts, params, **kw):
        outs = real(prompts, params, **kw)
        outs[1].outputs[0].token_ids = [*outs[1].outputs[0].token_ids[:-1], 0]
        return outs

    monkeypatch.setattr(llms["ngram"], "generate", one_token_off)
    with pytest.raises(AssertionError, match="ngram changed the tokens of prompt 1"):
        bench.check_same_tokens(llms, 4, 6)
