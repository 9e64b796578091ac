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


def test_a_draft_cut_from_the_default_model_keeps_its_vocabulary(default_gguf, tmp_path):
    """draft_model's draft: the default model's first two layers, its embeddings, norm and head,
    a GGUF the engine resolves as a draft of the same vocabulary."""
    import gguf

    from jaxserve.args import EngineArgs

    bench = load_benchmark("speculative")
    draft = bench.truncated_gguf(default_gguf, 2, str(tmp_path / "draft.gguf"))
    full, cut = gguf.GGUFReader(default_gguf), gguf.GGUFReader(draft)
    assert cut.fields["llama.block_count"].contents() == 2
    names = {t.name for t in cut.tensors}
    assert {"token_embd.weight", "output_norm.weight", "blk.1.ffn_down.weight"} <= names
    assert not any(n.startswith("blk.2.") for n in names)
    assert names == {
        t.name for t in full.tensors if not t.name.startswith("blk.") or t.name.split(".")[1] in "01"
    }
    spec = {"model": draft, "num_speculative_tokens": 2}
    config = EngineArgs(model=default_gguf, speculative_config=spec).create_engine_config()
    assert config.speculative_config.method == "draft_model"
    assert config.speculative_config.draft_model_config.get("num_hidden_layers") == 2
