"""An agent's loop through the OpenAI SDK, for each chat template jaxserve is tested with: the
model calls a tool (forced by tool_choice, so the tiny random model calls it too), the client
sends the assistant's message back as the SDK returns it (content null, tool_calls) with the
tool's result, and the model answers. The prompt of the second turn is read back through
/tokenize and /detokenize: the template saw the call's arguments and the result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import ClientSession
from server_inputs import MODEL
from tiny_models import engine_kwargs
from tool_schemas import TIME

from jaxserve.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints.openai.chat_prompt import render_chat_prompt
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
QUESTION = "What time is it in Zurich?"
RESULT = "It is 14:05 there."

# template: (--tool-call-parser of the model's own format, whether the template renders calls)
FAMILIES = {
    "smollm2": (None, False),  # the default model's: no tools, an assistant turn is its content
    "phi3": (None, False),  # Phi-3's: no tools, and tool results are left out of the prompt
    "qwen2.5": ("hermes", True),
    "qwen3": ("hermes", True),
    "llama3.1_json": ("llama3_json", True),
    "llama3.2_pythonic": ("pythonic", True),
    "mistral_v0.3": ("mistral", True),  # call ids must be 9 alphanumerics
}


@pytest.fixture(scope="module")
def llm_engine(tiny_llama_gqa) -> LLMEngine:
    """The tiny model with room for a tool-using template's prompt (a system text, the tools'
    schemas and two turns: ~1,000 tokens of the tiny tokenizer)."""
    args = EngineArgs(
        model=tiny_llama_gqa[0],
        served_model_name=[MODEL],
        hf_overrides={"max_position_embeddings": 2048},
        **engine_kwargs(num_gpu_blocks_override=300),
    )
    return LLMEngine.from_engine_args(args)


@pytest.fixture(scope="module")
def reference():
    """The shared server fixtures' greedy references are of the shared engine, not this one."""
    return {}


async def _rendered(base: str, messages: list, template: str) -> tuple[str, int]:
    """The prompt text the server renders for `messages`, and its length in tokens."""
    async with ClientSession() as http:
        body = {"model": MODEL, "messages": messages, "tools": [TIME], "chat_template": template}
        async with http.post(base + "tokenize", json=body) as r:
            assert r.status == 200, await r.text()
            tokens = (await r.json())["tokens"]
        async with http.post(base + "detokenize", json={"model": MODEL, "tokens": tokens}) as r:
            return (await r.json())["prompt"], len(tokens)


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_a_tool_round_trip_through_the_sdk(sdk, family):
    parser, renders_calls = FAMILIES[family]
    template = (TEMPLATES / f"{family}.jinja").read_text()
    client = await sdk(tool_call_parser=parser)
    base = str(client.base_url).removesuffix("v1/")
    extra = {"chat_template": template}
    messages: list = [{"role": "user", "content": QUESTION}]

    first = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=[TIME], tool_choice="required", parallel_tool_calls=False,
        temperature=1.0, seed=11, max_tokens=60, extra_body=extra,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    zone = json.loads(call.function.arguments)["zone"]
    if parser == "mistral":
        assert len(call.id) == 9 and call.id.isalnum()

    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=[TIME], tool_choice="none", temperature=0.0, max_tokens=6,
        extra_body=extra,
    )  # fmt: skip
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert isinstance(answer.message.content, str)

    sent = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    prompt, length = await _rendered(base, sent, template)
    assert final.usage.prompt_tokens == length
    if family == "phi3":
        assert RESULT not in prompt and prompt.count("<|assistant|>") == 2
        return
    assert prompt.index(QUESTION) < prompt.index(RESULT)
    if renders_calls:  # the call sits between the question and its result
        assert prompt.index(QUESTION) < prompt.rindex(zone) < prompt.index(RESULT)
        assert "get_time" in prompt[prompt.index(QUESTION) :]


def _render(messages: list[dict], template: str, content_format: str = "auto") -> str:
    from tiny_models import make_tokenizer

    body = ChatCompletionRequest(model=MODEL, messages=messages)
    return render_chat_prompt(make_tokenizer(300), body, template, content_format)


def test_messages_reach_the_template_as_vllm_normalises_them():
    """Content always present (empty for none; text parts joined or kept as parts), an
    assistant's reasoning under both names, a tool result's id, a name; nothing else."""
    template = (
        "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ m.reasoning_content }}|{{ m.reasoning }}"
        "|{{ m.tool_call_id }}|{{ m.name }}|{{ m.extra }}]{% endfor %}"
    )
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "name": "u",
        },
        {"role": "assistant", "reasoning": "thought", "tool_calls": [], "extra": 1},
        {"role": "assistant", "content": None, "reasoning_content": "other"},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
        {"role": "user", "content": "q", "tool_call_id": "not for users"},
    ]
    assert _render(messages, template) == (
        "[user|a\nb||||u|][assistant||thought|thought|||][assistant||other|other|||][tool|r|||c1||][user|q|||||]"
    )
    loops = "{% for m in messages %}{% for p in m.content %}<{{ p.text }}>{% endfor %};{% endfor %}"
    assert _render(messages[:3], loops) == "<a><b>;;;"


def test_qwen3_reads_the_reasoning_of_an_assistant_turn_that_called_a_tool():
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    messages = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Zurich is in CET.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "c1", "content": RESULT},
    ]
    prompt = _render(messages, (TEMPLATES / "qwen3.jinja").read_text())
    assert (
        "<|im_start|>assistant\n<think>\nZurich is in CET.\n</think>\n\n"
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call><|im_end|>\n'
        f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in prompt


async def test_a_template_that_refuses_tool_turns_answers_400_with_its_reason(sdk):
    """Gemma's template admits only alternating user and model turns: a tool result is the
    client's request for something the model's template cannot render, a 400 naming why."""
    import openai

    client = await sdk()
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": RESULT},
    ]
    template = (TEMPLATES / "gemma.jinja").read_text()
    with pytest.raises(openai.BadRequestError, match="roles must alternate"):
        await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[TIME],
            tool_choice="none",
            max_tokens=2,
            extra_body={"chat_template": template},
        )
    ok = await client.chat.completions.create(
        model=MODEL, messages=messages[:1], max_tokens=2, extra_body={"chat_template": template}
    )
    assert ok.usage.prompt_tokens > 0
