"""The real default model: SmolLM2-135M-Instruct from its GGUF file, against transformers'
own GGUF loader on the same file (float32)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from reference_checks import assert_greedy_generation_matches, prompt_logits, teacher_forced_logits
from tool_schemas import TIME, WEATHER

from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    # buckets compiled as the test needs them: the default start-up is covered by the CLI tests
    return LLM(
        max_model_len=1024,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        use_tqdm_on_load=False,
        enforce_eager=True,
        compilation_config={"token_buckets": [16, 256]},
    )


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    texts = [
        "The quick brown fox",
        "Water boils at a temperature of",
        "def fibonacci(n):\n    ",
        "In 1969, the first humans landed on",
    ]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Name three primary colors."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return [tok.encode(t) for t in texts + [chat]]


def test_logits_match_transformers(llm, smollm2_reference, prompts):
    runner = llm.llm_engine.runner
    for ids in prompts:
        ours = prompt_logits(runner, ids)
        ref = teacher_forced_logits(smollm2_reference, ids)
        # Logits here span about +-30. Served 4-bit on a CPU, the projections multiply x rounded
        # to int16 per group of 32 (pallas_kernels/quantized_matmul/cpu.cc): logits then differ
        # by up to ~0.025 (measured), ~8e-4 of that scale (float32 in XLA's order alone: ~2e-4);
        # a wrong group, nibble or tile would be off by whole units.
        scale = np.abs(ref).max()
        np.testing.assert_allclose(ours, ref, atol=2e-3 * scale, rtol=0)


def test_greedy_tokens_match_transformers(llm, smollm2_reference, prompts):
    assert_greedy_generation_matches(llm, smollm2_reference, prompts)


def test_chat_answers_paris(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_forced_tool_calls_end_within_a_few_dozen_tokens_at_temperature_one(llm, choice):
    """The grammar the server builds for tool_choice "required" or a named function, sampled on
    the default model: the call closes within 48 tokens (JSON's free whitespace and undeclared
    argument keys let this model wander past that in a third to a half of the samples)."""
    import jsonschema

    from jaxserve.entrypoints.openai.chat_tools import reply_tool_parser, tool_constraint
    from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    mode, name = ("required", None) if choice == "required" else ("named", choice)
    tool_choice = "required" if name is None else {"type": "function", "function": {"name": name}}
    body = ChatCompletionRequest(model="m", messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice)
    constraint = tool_constraint(body, mode, name)
    params = [
        SamplingParams(temperature=1.0, max_tokens=48, seed=s, structured_outputs=constraint)
        for s in range(16)
    ]
    outputs = llm.chat([messages] * 16, params, tools=[WEATHER, TIME], use_tqdm=False)
    finished = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 15, [o.outputs[0].text for o in outputs]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for text in finished:
        _, calls = reply_tool_parser(mode, name, None, None).extract_tool_calls(text)
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_served_as_an_embedder_it_pools_transformers_hidden_states(smollm2_reference, prompts):
    """The real default model as an embedding model (MEAN and LAST, from its 4-bit GGUF file):
    cosine >= 0.999 with transformers' last_hidden_state pooled the same way (the projections'
    int16 rounding of x, as for the logits above, is all that differs)."""
    import torch

    with torch.no_grad():
        hidden = [
            smollm2_reference.model(torch.tensor([ids])).last_hidden_state[0].numpy() for ids in prompts
        ]
    for pooling_type, pool in (("MEAN", lambda h: h.mean(0)), ("LAST", lambda h: h[-1])):
        embedder = LLM(
            runner="pooling",
            pooler_config={"pooling_type": pooling_type},
            max_model_len=256,
            max_num_batched_tokens=64,  # the chat prompt runs in chunks
            max_num_seqs=8,
            use_tqdm_on_load=False,
            enforce_eager=True,
            compilation_config={"token_buckets": [16, 64]},
        )
        outs = embedder.embed([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
        for out, h in zip(outs, hidden):
            want = pool(h) / np.linalg.norm(pool(h))
            assert float(np.dot(out.outputs.embedding, want)) > 0.999
