"""Structured outputs in the engine: every sample of a random-weight model at temperature 1 fits
its JSON schema, regex or choice; the mask agrees with llguidance's own numpy reference; greedy
constrained decoding picks transformers' best allowed token; constrained and unconstrained rows
share a batch without changing each other."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from tiny_models import engine_kwargs

from jaxserve import LLM, SamplingParams
from jaxserve.sampling_params import GuidedDecodingParams, StructuredOutputsParams

S = StructuredOutputsParams


def _obj(properties: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}  # fmt: skip


_NAME = {"type": "string", "maxLength": 8}
SCHEMAS = [
    _obj({"a": {"type": "integer", "minimum": 0, "maximum": 99}}),
    _obj({"flag": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 5}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}, "shade": {"enum": [1, 2, 3, None]}}),
    _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
    _obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}}),
    _obj(
        {
            "xs": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 4,
            }
        }
    ),  # fmt: skip
    _obj({"inner": _obj({"x": {"type": "integer", "minimum": 0, "maximum": 3}, "y": {"type": "boolean"}})}),
    _obj({"outer": _obj({"mid": _obj({"leaf": {"enum": ["a", "b"]}})})}),
    _obj(
        {
            "v": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 9},
                    {"type": "boolean"},
                    {"type": "null"},
                ]
            }
        }
    ),
    _obj(
        {
            "shape": {
                "anyOf": [
                    _obj({"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}}),
                    _obj(
                        {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}}
                    ),
                ]
            }
        }
    ),  # fmt: skip
    _obj({"day": {"type": "string", "format": "date"}}),
    _obj({"ip": {"type": "string", "format": "ipv4"}}),
    _obj({"id": {"type": "string", "format": "uuid"}}),
    _obj({"addr": {"type": "string", "format": "ipv6"}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    _obj({"opt": _NAME, "req": {"type": "boolean"}}, required=["req"]),
    {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 2, "maxItems": 5},
    {"type": "array", "items": _obj({"k": {"type": "integer", "minimum": 0, "maximum": 9}}), "maxItems": 2},
    {"enum": ["yes", "no", 3, True]},
    {"type": "integer", "minimum": 100, "maximum": 120},
    _obj({"ref": {"$ref": "#/$defs/pt"}})
    | {"$defs": {"pt": _obj({"x": {"type": "integer", "minimum": 0, "maximum": 5}})}},  # fmt: skip
    _obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
]
REGEXES = [
    r"[a-c]{2,4}-[0-9]{2}",
    r"(yes|no|maybe)!",
    r"[0-9]{3}-[0-9]{4}",
    r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5})?",
]
CHOICES = [["red", "green", "blue"], ["alpha beta", "gamma", "δέλτα"]]
SAMPLES_EACH = 36  # x 28 constraints = 1008 samples


def _constraints():
    for schema in SCHEMAS:
        yield S(json=schema, disable_any_whitespace=True), ("json", schema)
    for regex in REGEXES:
        yield S(regex=regex), ("regex", regex)
    for choice in CHOICES:
        yield S(choice=choice), ("choice", choice)


def _check(kind: str, spec, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), spec, format_checker=jsonschema.FormatChecker())
    elif kind == "regex":
        assert re.fullmatch(spec, text), (spec, text)
    else:
        assert text in spec, (spec, text)


@pytest.fixture(scope="module")
def llm(tiny_llama_gqa):
    path, _ = tiny_llama_gqa
    return LLM(
        model=path, **engine_kwargs(max_num_seqs=64, max_num_batched_tokens=256, num_gpu_blocks_override=512)
    )


def test_every_sample_at_temperature_one_fits_its_constraint(llm):
    constraints = list(_constraints())
    assert len(SCHEMAS) >= 20 and len(constraints) * SAMPLES_EACH >= 1000
    prompts, params, specs = [], [], []
    for c, (constraint, spec) in enumerate(constraints):
        for i in range(SAMPLES_EACH):
            prompts.append(f"Answer {c} {i}:")
            params.append(
                SamplingParams(
                    temperature=1.0, seed=1000 * c + i, max_tokens=200, structured_outputs=constraint
                )
            )
            specs.append(spec)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    distinct = {}
    for out, (kind, spec) in zip(outputs, specs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (spec, c.text)
        _check(kind, spec, c.text)
        distinct.setdefault(json.dumps(spec), set()).add(c.text)
    # temperature 1 explores: most constraints see several different outputs
    assert sum(len(v) > 1 for v in distinct.values()) >= len(constraints) - 4


def test_greedy_constrained_token_is_the_references_best_allowed_token(llm, tiny_llama_gqa):
    """Teacher-forced against transformers: each generated token is the argmax of the reference
    logits over the tokens llguidance allows at that point."""
    import llguidance
    import torch
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    _, model = tiny_llama_gqa
    schema = SCHEMAS[3]
    prompt = "Who are you?"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60,
                                              structured_outputs=S(json=schema, disable_any_whitespace=True)),
                       use_tqdm=False)[0]  # fmt: skip
    tokens = out.outputs[0].token_ids
    compiler = llm.llm_engine.grammars
    matcher = compiler.compile(S(json=schema, disable_any_whitespace=True))
    mask = allocate_token_bitmask(1, compiler.vocab_size)
    context = list(out.prompt_token_ids)
    for token in tokens:
        with torch.no_grad():
            logits = model(torch.tensor([context])).logits[0, -1].numpy().copy()
        fill_next_token_bitmask(matcher, mask, 0)
        llguidance.numpy.apply_token_bitmask_inplace(logits[None], mask)
        assert token == int(np.argmax(logits))
        assert matcher.consume_token(token)
        context.append(token)
    assert matcher.is_stopped()
    jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_constrained_rows_leave_their_neighbours_alone(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(["one", "two"], plain, use_tqdm=False)]
    constrained = SamplingParams(temperature=0.7, seed=5, max_tokens=30, structured_outputs=S(regex=r"\d{5}"))
    mixed = llm.generate(["one", "x", "two", "y"], [plain, constrained, plain, constrained], use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    for o in (mixed[1], mixed[3]):
        assert re.fullmatch(r"\d{5}", o.outputs[0].text)


def test_sampler_features_under_a_constraint(llm):
    """n, seeds, logprobs and penalties work through the mask: seeded samples repeat, and the
    logprobs are of the masked distribution (vLLM's): only allowed tokens are finite, and a token
    that is the only one allowed has logprob 0."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    choice = ["cat", "dog", "bird", "fish", "catfish"]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, logprobs=3, presence_penalty=1.0,
                            structured_outputs=GuidedDecodingParams(choice=choice))  # fmt: skip
    first = llm.generate("Pets:", params, use_tqdm=False)[0]
    again = llm.generate("Pets:", params, use_tqdm=False)[0]
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    compiler = llm.llm_engine.grammars
    mask = allocate_token_bitmask(1, compiler.vocab_size)
    forced = 0
    for c in first.outputs:
        assert c.text in choice
        matcher = compiler.compile(S(choice=choice))
        for token, entry in zip(c.token_ids, c.logprobs, strict=True):
            fill_next_token_bitmask(matcher, mask, 0)
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: compiler.vocab_size]
            allowed = set(np.flatnonzero(bits).tolist())
            assert token in allowed and token in entry
            assert {t for t, lp in entry.items() if np.isfinite(lp.logprob)} <= allowed
            if len(allowed) == 1:
                forced += 1
                assert entry[token].logprob == pytest.approx(0.0, abs=1e-5)
            matcher.consume_token(token)
    assert forced > 0


def test_no_mask_step_without_a_constrained_row(llm):
    """An unconstrained batch runs a variant without the mask: nothing new is compiled for it,
    even after constrained batches ran."""
    llm.generate("x", SamplingParams(max_tokens=3, structured_outputs=S(regex="[ab]+")), use_tqdm=False)
    runner = llm.llm_engine.runner
    llm.generate(["a", "b"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    before = set(runner.steps.compiled)
    llm.generate(["c", "d", "e"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert set(runner.steps.compiled) == before


def test_apply_token_bitmask_matches_llguidance_reference():
    import jax.numpy as jnp
    from llguidance.numpy import apply_token_bitmask_inplace

    from jaxserve.layers.sampler import apply_token_bitmask

    rng = np.random.default_rng(0)
    for vocab in (31, 32, 100, 512):
        logits = rng.normal(size=(5, vocab)).astype(np.float32)
        mask = rng.integers(-(2**31), 2**31, size=(5, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
        expected = logits.copy()
        apply_token_bitmask_inplace(expected, mask)
        got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
        np.testing.assert_array_equal(got, expected)


def test_compiled_grammars_are_cached_and_bad_ones_refused(llm):
    compiler = llm.llm_engine.grammars
    params = S(json={"type": "object", "properties": {"q": {"type": "integer"}}})
    compiler.compile(params)
    size = compiler.num_cached
    compiler.compile(S(json={"type": "object", "properties": {"q": {"type": "integer"}}}))
    assert compiler.num_cached == size
    for bad, words in [
        (S(regex="a(b"), "unclosed group"),
        (S(json={"type": "objec"}), "objec"),
        (S(json="{oops"), "not valid JSON"),
        (S(grammar="start: ("), "grammar"),
        (S(regex="a", backend="xgrammar"), "torch"),
    ]:
        with pytest.raises(ValueError, match=words):
            llm.generate("x", SamplingParams(max_tokens=2, structured_outputs=bad), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        S(json={}, regex="a")
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=S(regex="a"), guided_decoding=S(regex="b"))


def test_beam_search_under_a_constraint(llm):
    """Every beam is held to the grammar: each finished sequence is a full match, and the best
    beam's score is its cumulative logprob over the masked distribution."""
    from jaxserve.beam_search import BeamSearchParams

    regex = r"(red|green|blue)-[0-9]{2}"
    params = BeamSearchParams(beam_width=3, max_tokens=20, structured_outputs=S(regex=regex))
    tok = llm.get_tokenizer()
    [out] = llm.beam_search(["Colours:"], params)
    prompt_len = len(tok.encode("Colours:"))
    assert len(out.sequences) == 3
    for seq in out.sequences:
        generated = [t for t in seq.tokens[prompt_len:] if t != tok.eos_token_id]
        assert seq.finish_reason == "stop" and re.fullmatch(regex, tok.decode(generated)), seq
    assert len({tuple(s.tokens) for s in out.sequences}) == 3


def test_constraint_starts_after_the_reasoning(tiny_llama_gqa, tmp_path):
    """With --reasoning-parser, the tokens before </think> are free and the grammar holds the
    answer after it: the answer matches, the thinking need not."""
    import shutil

    from tiny_models import make_tokenizer
    from tokenizers import AddedToken

    from jaxserve.reasoning import get_reasoning_parser

    shutil.copytree(tiny_llama_gqa[0], tmp_path, dirs_exist_ok=True)
    tok = make_tokenizer(510)
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save_pretrained(tmp_path)
    end = tok.convert_tokens_to_ids("</think>")
    assert end < 512  # inside the model's vocabulary
    llm = LLM(model=str(tmp_path), reasoning_parser="deepseek_r1", **engine_kwargs())
    regex = r"[0-9]{3}"
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=40, logit_bias={end: 6.0},
                            structured_outputs=S(regex=regex))  # fmt: skip
    outs = llm.generate([f"Think {i}:" for i in range(8)], params, use_tqdm=False)
    parser = get_reasoning_parser("deepseek_r1")(llm.get_tokenizer())
    free = 0
    for out in outs:
        c = out.outputs[0]
        assert c.token_ids.count(end) == 1 and c.finish_reason == "stop", c.text
        reasoning, content = parser.split(c.text, final=True)
        assert re.fullmatch(regex, content), c.text
        free += bool(reasoning) and not re.fullmatch(r"[0-9]*", reasoning)
    assert free > 0  # some thinking used tokens the answer's grammar would have refused


def test_offline_chat_shows_the_tools_to_the_template(llm):
    template = (
        "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    )
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    [out] = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                     chat_template=template, tools=[tool])  # fmt: skip
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert prompt.startswith("[tool get_weather]user: Hi")
