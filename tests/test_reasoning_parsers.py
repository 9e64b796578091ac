"""Reasoning parsers: the (reasoning, content) split of whole outputs, the streamed deltas that
reassemble it, and the end-of-thinking check on token ids."""

from __future__ import annotations

import random
import zlib

import pytest

from jaxserve.reasoning import (
    DeepSeekR1ReasoningParser,
    Glm45ReasoningParser,
    GraniteReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
    reasoning_parser_names,
)

MARKERS = ("<think>", "</think>")

# (output, (reasoning, content)) per family, as the models write them.
R1_CASES = {
    "both markers": (
        "<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4.",
        ("\nLet me add 2 and 2.\n", "\n\nThe answer is 4."),
    ),
    "start marker in the prompt": (
        "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.",
        ("Okay, 2 + 2 is 4.\n", "\n\nThe answer is 4."),
    ),
    "unfinished at max_tokens": ("<think>\nFirst, let me recall what", ("\nFirst, let me recall what", None)),
    "unfinished, no start marker": ("Hmm, the user wants", ("Hmm, the user wants", None)),
    "stops right after thinking": ("<think>\nDone.\n</think>", ("\nDone.\n", None)),
    "empty thought": ("<think>\n\n</think>\n\nHello!", ("\n\n", "\n\nHello!")),
    "ends in a partial marker": ("I think</thi", ("I think</thi", None)),
    "markers and tags in the answer": (
        "<think>a < b</think>Use <b>bold</b>; x < y <= z",
        ("a < b", "Use <b>bold</b>; x < y <= z"),
    ),
    "empty output": ("", (None, None)),
}

QWEN3_CASES = {
    "thinking": (
        "<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4.",
        ("\nLet me add 2 and 2.\n", "\n\nThe answer is 4."),
    ),
    "thinking-2507, start marker in the prompt": (
        "The user asks for 2 + 2.\n</think>\n\nThe answer is 4.",
        ("The user asks for 2 + 2.\n", "\n\nThe answer is 4."),
    ),
    "empty think block (/no_think)": (
        "<think>\n\n</think>\n\nThe answer is 4.",
        ("\n\n", "\n\nThe answer is 4."),
    ),
    "unfinished at max_tokens": ("<think>\nOkay, so I need", ("\nOkay, so I need", None)),
    "unfinished, start marker in the prompt": ("Okay, so I need", ("Okay, so I need", None)),
    "tool call after thinking": (
        '<think>\nCall the tool.\n</think>\n\n<tool_call>\n{"name": "f"}\n</tool_call>',
        ("\nCall the tool.\n", '\n\n<tool_call>\n{"name": "f"}\n</tool_call>'),
    ),
}

GLM45_CASES = {
    "thinking": (
        "<think>The user wants 2 + 2.</think>\nThe answer is 4.",
        ("The user wants 2 + 2.", "\nThe answer is 4."),
    ),
    "thinking off: the answer alone": ("The answer is 4.", (None, "The answer is 4.")),
    "unfinished at max_tokens": ("<think>Let me see", ("Let me see", None)),
    "tool call after thinking": (
        "<think>Call it.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>",
        ("Call it.", "\n<tool_call>get_weather\n<arg_key>city</arg_key>"),
    ),
}

GRANITE_CASES = {
    "thinking": (
        "Here is my thought process:\nAdd 2 and 2.\nHere is my response:\nThe answer is 4.",
        ("\nAdd 2 and 2.\n", "\nThe answer is 4."),
    ),
    "contracted phrases": (
        "Here's my thought process: 2 + 2.\nHere's my response: 4.",
        (" 2 + 2.\n", " 4."),
    ),
    "thinking off: the answer alone": ("Hello! The answer is 4.", (None, "Hello! The answer is 4.")),
    "unfinished at max_tokens": ("Here is my thought process:\nFirst, Here is", ("\nFirst, Here is", None)),
    "the opening words only": ("Here is", (None, "Here is")),
}

PARSERS = {
    "deepseek_r1": (DeepSeekR1ReasoningParser, R1_CASES),
    "qwen3": (Qwen3ReasoningParser, QWEN3_CASES),
    "glm45": (Glm45ReasoningParser, GLM45_CASES),
    "granite": (GraniteReasoningParser, GRANITE_CASES),
}
ALL_CASES = [
    pytest.param(name, text, expected, id=f"{name}: {case}")
    for name, (_, cases) in PARSERS.items()
    for case, (text, expected) in cases.items()
]


def _no_marker_piece(part: str) -> None:
    """No marker, and no piece of one that starts with its `<` and has more than the `<`."""
    for marker in MARKERS:
        assert marker not in part
        for n in range(2, len(marker)):
            assert marker[:n] not in part, (part, marker[:n])


def _stream(parser: ReasoningParser, text: str, cuts: list[int]) -> tuple[str, str, list[dict]]:
    stream = ReasoningStream(parser)
    deltas = []
    for i, cut in enumerate(cuts):
        deltas.append(stream.update(text[:cut], final=i == len(cuts) - 1))
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    return reasoning, content, deltas


def _random_cuts(rng: random.Random, n: int) -> list[int]:
    cuts, at = [], 0
    while at < n:
        at = min(n, at + rng.randint(1, 9))
        cuts.append(at)
    return cuts or [0]


@pytest.mark.parametrize("name, text, expected", ALL_CASES)
def test_split_of_the_whole_output(name, text, expected):
    parser = get_reasoning_parser(name)(None)
    assert parser.split(text, final=True) == expected


@pytest.mark.parametrize("name, text, expected", ALL_CASES)
def test_streamed_deltas_reassemble_the_split(name, text, expected):
    parser = get_reasoning_parser(name)(None)
    want = tuple(part or "" for part in expected)
    rng = random.Random(zlib.crc32(text.encode()))
    chunkings = [list(range(1, len(text) + 1)) or [0], [len(text)]]
    chunkings += [_random_cuts(rng, len(text)) for _ in range(20)]
    for cuts in chunkings:
        reasoning, content, deltas = _stream(parser, text, cuts)
        assert (reasoning, content) == want, cuts
        for delta in deltas:
            assert delta.get("reasoning") == delta.get("reasoning_content")
            assert set(delta) <= {"reasoning", "reasoning_content", "content"}
            assert all(delta.values())


@pytest.mark.parametrize("name, text, expected", ALL_CASES)
def test_non_final_splits_only_grow(name, text, expected):
    parser = get_reasoning_parser(name)(None)
    before = ("", "")
    for cut in range(len(text) + 1):
        now = tuple(p or "" for p in parser.split(text[:cut], final=False))
        final = tuple(p or "" for p in parser.split(text[:cut], final=True))
        for old, new, last in zip(before, now, final):
            assert new.startswith(old) and last.startswith(new)
        before = now


def test_deltas_never_carry_a_marker_or_part_of_one():
    text = "<think>\nIs 3 < 4? Yes.\n</think>\n\n3 is less than 4."
    for name in ("deepseek_r1", "qwen3", "glm45"):  # the parsers of the think markers
        parser = get_reasoning_parser(name)(None)
        rng = random.Random(7)
        for cuts in [list(range(1, len(text) + 1))] + [_random_cuts(rng, len(text)) for _ in range(30)]:
            _, _, deltas = _stream(parser, text, cuts)
            for delta in deltas:
                for part in delta.values():
                    _no_marker_piece(part)


def test_a_marker_split_across_chunks_is_held_back():
    parser = DeepSeekR1ReasoningParser(None)
    stream = ReasoningStream(parser)
    assert stream.update("<thi", final=False) == {}
    assert stream.update("<think>\nSo 4", final=False) == {
        "reasoning_content": "\nSo 4",
        "reasoning": "\nSo 4",
    }
    assert stream.update("<think>\nSo 4.</", final=False) == {"reasoning_content": ".", "reasoning": "."}
    assert stream.update("<think>\nSo 4.</thin", final=False) == {}
    assert stream.update("<think>\nSo 4.</think>", final=False) == {}
    assert stream.update("<think>\nSo 4.</think>\n\nIt is 4", final=False) == {"content": "\n\nIt is 4"}
    assert stream.update("<think>\nSo 4.</think>\n\nIt is 4 <", final=False) == {"content": " "}
    assert stream.update("<think>\nSo 4.</think>\n\nIt is 4 <", final=True) == {"content": "<"}


def test_a_partial_marker_left_at_the_end_is_text():
    stream = ReasoningStream(Qwen3ReasoningParser(None))
    assert stream.update("I think</thi", final=False) == {
        "reasoning_content": "I think",
        "reasoning": "I think",
    }
    assert stream.update("I think</thi", final=True) == {"reasoning_content": "</thi", "reasoning": "</thi"}


def test_qwen3_streams_the_open_thought_as_reasoning():
    stream = ReasoningStream(Qwen3ReasoningParser(None))
    assert stream.update("<think>\nOkay", final=False) == {
        "reasoning_content": "\nOkay",
        "reasoning": "\nOkay",
    }
    assert stream.update("<think>\nOkay, so", final=False) == {
        "reasoning_content": ", so",
        "reasoning": ", so",
    }


def test_thinking_disabled_in_the_prompt_makes_everything_content():
    """Qwen3 with enable_thinking=False: the template closed an empty thought in the prompt and
    the output has no markers; the caller sees that from the prompt ids and streams content."""
    parser = Qwen3ReasoningParser(_tokenizer())
    prompt = _ids("<|im_start|> user Hi <|im_end|> <|im_start|> assistant <think> </think>")
    assert parser.is_reasoning_end(prompt)
    text = "The answer is 4."
    stream = ReasoningStream(parser, reasoning_ended=parser.is_reasoning_end(prompt))
    deltas = [stream.update(text[:n], final=n == len(text)) for n in range(1, len(text) + 1)]
    assert "".join(d.get("content", "") for d in deltas) == text
    assert not any("reasoning" in d for d in deltas)


# A tiny tokenizer with the markers as added tokens, as in the Qwen3 and R1 vocabularies.
WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "Hi", "The", "answer", "is", "4", "."]


def _tokenizer(markers: tuple[str, ...] = MARKERS):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_tokens(list(markers))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def _ids(text: str) -> list[int]:
    return _tokenizer().encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_marker_ids_come_from_the_vocabulary(name):
    parser = get_reasoning_parser(name)(_tokenizer())
    assert (parser.start_token_id, parser.end_token_id) == (len(WORDS), len(WORDS) + 1)
    assert (ReasoningParser(None).start_token_id, ReasoningParser(None).end_token_id) == (None, None)


def test_marker_ids_through_convert_tokens_to_ids():
    class Lookup:
        unk_token_id = 0

        def convert_tokens_to_ids(self, token):
            return {"<think>": 5, "</think>": 6}.get(token, 0)

    parser = Qwen3ReasoningParser(Lookup())
    assert (parser.start_token_id, parser.end_token_id) == (5, 6)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_is_reasoning_end(name):
    parser = get_reasoning_parser(name)(_tokenizer())
    think, end = parser.start_token_id, parser.end_token_id
    chat = _ids("<|im_start|> user Hi <|im_end|> <|im_start|> assistant")
    assert not parser.is_reasoning_end(chat)
    assert not parser.is_reasoning_end([])
    assert not parser.is_reasoning_end(chat + [think])  # the template opened the thought
    assert parser.is_reasoning_end(chat + [think, end])  # enable_thinking=False: a closed empty block
    assert parser.is_reasoning_end(_ids("<|im_start|> assistant <think> </think> The answer"))
    assert not parser.is_reasoning_end(chat + [think, end] + _ids("Hi") + [think] + _ids("Hi"))
    assert parser.is_reasoning_end(_ids("Hi . </think> The answer is"))  # R1 style: no start marker
    assert not ReasoningParser(None).is_reasoning_end(chat + [think, end])


def test_content_token_ids():
    parser = DeepSeekR1ReasoningParser(_tokenizer())
    think, end = parser.start_token_id, parser.end_token_id
    answer = _ids("The answer is 4 .")
    assert parser.content_token_ids([think] + _ids("Hi") + [end] + answer) == answer
    assert parser.content_token_ids(_ids("Hi") + [end] + _ids("Hi") + [end] + answer) == answer
    assert parser.content_token_ids([think] + _ids("Hi .")) == []
    assert parser.content_token_ids([think, end]) == []


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_a_tokenizer_without_the_end_marker_is_refused(name):
    with pytest.raises(ValueError, match=r"</think>.*tokenizer|reasoning parser.*</think>") as info:
        get_reasoning_parser(name)(_tokenizer(markers=()))
    assert get_reasoning_parser(name).__name__ in str(info.value)
    with pytest.raises(ValueError, match="</think>"):
        get_reasoning_parser(name)(_tokenizer(markers=("<think>",)))


def test_a_missing_start_marker_is_allowed():
    parser = DeepSeekR1ReasoningParser(_tokenizer(markers=("</think>",)))
    assert parser.start_token_id is None and parser.end_token_id == len(WORDS)
    assert parser.is_reasoning_end(_ids("Hi") + [parser.end_token_id])


def test_register_a_parser_with_other_markers(monkeypatch):
    import jaxserve.reasoning as reasoning

    monkeypatch.setattr(reasoning, "_PARSERS", dict(reasoning._PARSERS))

    @reasoning.register_reasoning_parser("seed_think")
    class SeedThink(ReasoningParser):
        start_marker, end_marker = "<seed:think>", "</seed:think>"

    assert get_reasoning_parser("seed_think") is SeedThink
    parser = SeedThink(None)
    text = "<seed:think>plan</seed:think>answer"
    assert parser.split(text, final=True) == ("plan", "answer")
    assert parser.split(text[:20], final=False) == ("plan", None)
    reasoning_text, content, _ = _stream(parser, text, list(range(1, len(text) + 1)))
    assert (reasoning_text, content) == ("plan", "answer")


def test_registry():
    assert {"deepseek_r1", "qwen3"} <= set(reasoning_parser_names())
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="deepseek_r1.*qwen3") as info:
        get_reasoning_parser("deepseek-v9")
    assert "deepseek-v9" in str(info.value)
