"""Logprobs and the rest of the sampling fields through the OpenAI endpoints: OpenAI's
shapes, the offline engine's values, streams that add up to the plain answer, and vLLM's
extras (echo with logprobs, prompt_logprobs, --return-tokens-as-token-ids)."""

from __future__ import annotations

import pytest
from server_inputs import MAX_TOKENS, MODEL, PROMPTS

from jaxserve.entrypoints.openai.logprobs import LogprobFormatter
from jaxserve.outputs import Logprob
from jaxserve.sampling_params import SamplingParams

openai = pytest.importorskip("openai")

K = 3  # logprobs asked of the completions endpoint
CHAT_K = 2  # top_logprobs asked of the chat endpoint
PROMPT = PROMPTS[3]
MESSAGES = [{"role": "user", "content": PROMPTS[7]}]
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def offline(llm_engine):
    """The engine's own greedy outputs (with logprobs) for the completion prompt and the
    chat conversation, run before any server thread owns the engine."""
    tok = llm_engine.tokenizer
    chat_text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    runs = {
        "cmpl": (tok.encode(PROMPT), SamplingParams(**GREEDY, logprobs=K, prompt_logprobs=K)),
        "chat": (
            tok.encode(chat_text, add_special_tokens=False),
            SamplingParams(**GREEDY, logprobs=CHAT_K, prompt_logprobs=1),
        ),
    }
    for name, (ids, params) in runs.items():
        llm_engine.add_request(f"offline-{name}", {"prompt_token_ids": ids}, params)
    done = {}
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished:
                done[out.request_id.removeprefix("offline-")] = out
    return done


@pytest.fixture
async def client(server):
    c = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
    yield c
    await c.close()


def close(a: float, b: float) -> bool:
    return a == pytest.approx(b, abs=1e-5)


def check_completion_logprobs(lp: dict, token_ids: list[int], entries: list) -> None:
    """`lp` (the completions API's logprobs) shows exactly these engine entries."""
    assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert all(len(lp[key]) == len(token_ids) for key in lp)
    offset = 0
    for i, (token_id, entry) in enumerate(zip(token_ids, entries, strict=True)):
        assert lp["text_offset"][i] == offset
        offset += len(lp["tokens"][i])
        if entry is None:  # the first prompt token
            assert lp["token_logprobs"][i] is None and lp["top_logprobs"][i] is None
            continue
        chosen = entry[token_id]
        assert lp["tokens"][i] == chosen.decoded_token
        assert close(lp["token_logprobs"][i], chosen.logprob)
        expected: dict[str, float] = {}
        for other in entry.values():
            expected.setdefault(other.decoded_token, other.logprob)
        assert lp["top_logprobs"][i].keys() == expected.keys()
        assert all(close(lp["top_logprobs"][i][t], v) for t, v in expected.items())


def same_logprobs(a: dict, b: dict) -> bool:
    if a.keys() != b.keys() or a["tokens"] != b["tokens"] or a["text_offset"] != b["text_offset"]:
        return False
    pairs = [
        (x, y) for key in ("token_logprobs", "top_logprobs") for x, y in zip(a[key], b[key], strict=True)
    ]
    for x, y in pairs:
        if isinstance(x, dict):
            if x.keys() != y.keys() or not all(close(x[t], y[t]) for t in x):
                return False
        elif (x is None) != (y is None) or (x is not None and not close(x, y)):
            return False
    return True


def joined(chunks, index: int = 0) -> dict:
    """The logprobs of a completions stream's chunks for one choice, put end to end."""
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for chunk in chunks:
        for c in chunk.choices:
            if c.index == index:
                for key, values in c.logprobs.model_dump().items():
                    out[key] += values
    return out


async def test_completion_logprobs_match_the_engine_streamed_or_not(client, offline):
    ref = offline["cmpl"].outputs[0]
    plain = await client.completions.create(model=MODEL, prompt=PROMPT, logprobs=K, **GREEDY)
    (choice,) = plain.choices
    assert choice.text == ref.text
    lp = choice.logprobs.model_dump()
    check_completion_logprobs(lp, ref.token_ids, ref.logprobs)
    assert all(len(top) <= K + 1 for top in lp["top_logprobs"])  # the chosen token and the top K
    if "\ufffd" not in "".join(lp["tokens"]):
        assert "".join(lp["tokens"]) == choice.text
    assert choice.model_extra["prompt_logprobs"] is None  # not asked for
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, logprobs=K, stream=True, **GREEDY)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert same_logprobs(joined(chunks), lp)


async def test_echo_puts_the_prompt_logprobs_first(client, offline, llm_engine):
    ref = offline["cmpl"]
    prompt_ids = ref.prompt_token_ids
    plain = await client.completions.create(model=MODEL, prompt=PROMPT, logprobs=K, echo=True, **GREEDY)
    (choice,) = plain.choices
    assert choice.text == PROMPT + ref.outputs[0].text
    lp = choice.logprobs.model_dump()
    token_ids = [*prompt_ids, *ref.outputs[0].token_ids]
    check_completion_logprobs(lp, token_ids, [*ref.prompt_logprobs, *ref.outputs[0].logprobs])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][0] == llm_engine.tokenizer.decode([prompt_ids[0]])
    # the engine was asked for prompt logprobs, so they come back on the choice as well
    assert len(choice.model_extra["prompt_logprobs"]) == len(prompt_ids)
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPT, logprobs=K, echo=True, stream=True, **GREEDY
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert same_logprobs(joined(chunks), lp)


async def test_prompt_logprobs_extra_field(client, offline):
    ref = offline["cmpl"]
    plain = await client.completions.create(
        model=MODEL, prompt=PROMPT, **GREEDY, extra_body={"prompt_logprobs": K}
    )
    (choice,) = plain.choices
    assert choice.logprobs is None
    got = choice.model_extra["prompt_logprobs"]
    assert len(got) == len(ref.prompt_token_ids) and got[0] is None
    for entry, expected in zip(got[1:], ref.prompt_logprobs[1:], strict=True):
        assert list(entry) == [str(t) for t in expected]  # the prompt token first, then the top K
        for t, lp in expected.items():
            e = entry[str(t)]
            assert set(e) == {"logprob", "rank", "decoded_token"}
            assert close(e["logprob"], lp.logprob) and e["rank"] == lp.rank
            assert e["decoded_token"] == lp.decoded_token


def check_chat_logprobs(content: list[dict], token_ids: list[int], entries: list) -> None:
    assert len(content) == len(token_ids)
    for item, token_id, entry in zip(content, token_ids, entries, strict=True):
        chosen = entry[token_id]
        assert item["token"] == chosen.decoded_token and close(item["logprob"], chosen.logprob)
        if "\ufffd" not in item["token"]:
            assert item["bytes"] == list(item["token"].encode())
        by_rank = sorted(entry.items(), key=lambda kv: kv[1].rank)[:CHAT_K]
        assert [t["token"] for t in item["top_logprobs"]] == [lp.decoded_token for _, lp in by_rank]
        assert all(close(t["logprob"], lp.logprob) for t, (_, lp) in zip(item["top_logprobs"], by_rank))
        assert all(set(t) == {"token", "logprob", "bytes"} for t in item["top_logprobs"])


async def test_chat_logprobs_match_the_engine_streamed_or_not(client, offline):
    ref = offline["chat"]
    common = dict(
        model=MODEL, messages=MESSAGES, temperature=0, max_completion_tokens=MAX_TOKENS, logprobs=True,
        top_logprobs=CHAT_K,
    )  # fmt: skip
    plain = await client.chat.completions.create(**common, extra_body={"prompt_logprobs": 1})
    (choice,) = plain.choices
    assert choice.message.content == ref.outputs[0].text
    content = [c.model_dump() for c in choice.logprobs.content]
    check_chat_logprobs(content, ref.outputs[0].token_ids, ref.outputs[0].logprobs)
    prompt_logprobs = plain.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ref.prompt_token_ids)
    assert all(
        close(got[str(t)]["logprob"], lp.logprob)
        for got, expected in zip(prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True)
        for t, lp in expected.items()
    )
    stream = await client.chat.completions.create(**common, stream=True)
    chunks = [c async for c in stream]
    streamed = [
        t.model_dump() for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content
    ]
    assert [t["token"] for t in streamed] == [t["token"] for t in content]
    check_chat_logprobs(streamed, ref.outputs[0].token_ids, ref.outputs[0].logprobs)
    # logprobs without top_logprobs: the chosen tokens only
    plain = await client.chat.completions.create(**{**common, "top_logprobs": None})
    assert [c.top_logprobs for c in plain.choices[0].logprobs.content] == [[]] * len(content)


async def test_tokens_as_token_ids(make_server, offline):
    server = await make_server(return_tokens_as_token_ids=True)
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
    ref = offline["cmpl"].outputs[0]
    plain = await client.completions.create(model=MODEL, prompt=PROMPT, logprobs=K, **GREEDY)
    lp = plain.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ref.token_ids]
    assert [set(top) for top in lp.top_logprobs] == [{f"token_id:{t}" for t in e} for e in ref.logprobs]
    assert lp.text_offset[1] == len(lp.tokens[0])
    chat = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_completion_tokens=MAX_TOKENS, logprobs=True,
        top_logprobs=1,
    )  # fmt: skip
    chat_ref = offline["chat"].outputs[0]
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat_ref.token_ids]
    assert [c.top_logprobs[0].token for c in content] == [f"token_id:{t}" for t in chat_ref.token_ids]
    for c, t, entry in zip(content, chat_ref.token_ids, chat_ref.logprobs, strict=True):
        if "\ufffd" not in entry[t].decoded_token:  # bytes stay those of the token's text
            assert c.bytes == list(entry[t].decoded_token.encode())
    # the request's own field wins over the flag
    plain = await client.completions.create(
        model=MODEL, prompt=PROMPT, logprobs=0, **GREEDY, extra_body={"return_tokens_as_token_ids": False}
    )
    assert plain.choices[0].logprobs.tokens == [
        ref.logprobs[i][t].decoded_token for i, t in enumerate(ref.token_ids)
    ]
    await client.close()


def test_partial_characters_keep_their_raw_bytes(llm_engine):
    tok = llm_engine.tokenizer
    formatter = LogprobFormatter(tok)
    text = "日本語 🙂 café"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.convert_tokens_to_string([t]) for t in tok.convert_ids_to_tokens(ids)]
    assert any("\ufffd" in p for p in pieces), "the test text should split a character"
    data = [formatter.token_bytes(t, Logprob(0.0, 1, p)) for t, p in zip(ids, pieces, strict=True)]
    assert bytes(b for piece in data for b in piece) == text.encode()
    assert [formatter.token_text(t, Logprob(0.0, 1, p), False) for t, p in zip(ids, pieces)] == pieces
    assert formatter.token_text(ids[0], None, True) == f"token_id:{ids[0]}"
    assert formatter.token_text(ids[0], None, False) == tok.decode([ids[0]])


async def test_logit_bias_and_allowed_token_ids_steer_the_sampler(client, reference, llm_engine):
    (forced,) = llm_engine.tokenizer.encode(" quick", add_special_tokens=False)
    out = await client.completions.create(
        model=MODEL, prompt=PROMPT, logit_bias={str(forced): 500}, logprobs=0, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].text == " quick" * 4
    # logprobs=0: the chosen token alone, with its logprob before the bias (the raw one)
    assert all(list(top) == [" quick"] for top in out.choices[0].logprobs.top_logprobs)
    assert all(lp < -1.0 for lp in out.choices[0].logprobs.token_logprobs)
    # banning the greedy first token changes the answer
    text, token_ids = reference[PROMPTS[0]]
    banned = await client.completions.create(
        model=MODEL, prompt=PROMPTS[0], logit_bias={str(token_ids[0]): -100}, **GREEDY
    )
    assert banned.choices[0].text != text
    # allowed_token_ids keeps to its list; the penalties pass through
    allowed = [
        forced,
        *(llm_engine.tokenizer.encode(w, add_special_tokens=False)[0] for w in (" the", " fox")),
    ]
    out = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3, logprobs=1,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "repetition_penalty": 1.3,
                    "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 2,
                    "return_tokens_as_token_ids": True},
    )  # fmt: skip
    tokens = out.choices[0].logprobs.tokens
    assert len(tokens) == 6 and {int(t.removeprefix("token_id:")) for t in tokens} <= set(allowed)


async def test_n_samples_each_carry_their_logprobs(client):
    common = dict(model=MODEL, prompt=PROMPT, n=2, logprobs=2, max_tokens=6, temperature=1.0, seed=11)
    plain = await client.completions.create(**common, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in plain.choices) == [0, 1]
    for c in plain.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert 2 <= len(top) <= 3 and value <= 0.0
            assert close(top[token], value)  # the chosen token leads top_logprobs
    stream = await client.completions.create(**common, stream=True, extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    for c in plain.choices:
        assert same_logprobs(joined(chunks, c.index), c.logprobs.model_dump())
    chat = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, logprobs=True, top_logprobs=1, max_completion_tokens=4,
        temperature=1.0, seed=5, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [len(c.logprobs.content) for c in chat.choices] == [4, 4]


BEAM_PROMPT = [5, 17, 99, 23, 44, 8, 120]


async def test_beam_search_returns_transformers_beams(client, tiny_llama_gqa, llm_engine):
    """use_beam_search with n=3: transformers' three beams, best first; streamed, the same
    answer arrives in one piece per choice."""
    from reference_checks import hf_beams

    seqs, _ = hf_beams(tiny_llama_gqa[1], BEAM_PROMPT, 3, 5, 1.0, eos=None)
    want = [llm_engine.tokenizer.decode(s, skip_special_tokens=True) for s in seqs]
    kw = dict(model=MODEL, prompt=BEAM_PROMPT, n=3, max_tokens=5, temperature=0.0)
    extra = {"use_beam_search": True, "ignore_eos": True}
    out = await client.completions.create(**kw, extra_body=extra)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == want
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 15
    streamed = {}
    async for chunk in await client.completions.create(**kw, extra_body=extra, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == want


async def test_best_of_returns_the_most_likely_samples(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=3)
    every = await client.completions.create(**kw, n=3, logprobs=0)
    best = await client.completions.create(**kw, n=1, extra_body={"best_of": 3}, logprobs=0)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert len(best.choices) == 1 and best.choices[0].text == ranked[0].text


async def test_chat_beam_search_answers_with_the_beams(client):
    kw = dict(model=MODEL, messages=MESSAGES, n=2, max_tokens=4, temperature=0.0)
    out = await client.chat.completions.create(**kw, extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content != out.choices[1].message.content
    assert out.usage.completion_tokens == 8
