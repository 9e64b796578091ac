"""The GGUF tokenizer built without torch gives transformers' GGUF tokenizer's ids, byte for byte.

Two families of byte-level GGUF vocabularies: the real default model's (llama architecture, the
``smollm`` pre-tokenizer, which splits as GPT-2 does) and a ``qwen2`` file written from the same
49k-token vocabulary with Qwen2's pre-tokenizer name, its special and user-defined tokens and a
tool-calling ChatML template. The sentencepiece (``llama`` tokenizer model) path is checked on a
tiny vocabulary in test_gguf.py.
"""

from __future__ import annotations

import os

import gguf
import pytest

from jaxserve.loader.gguf import load_gguf_tokenizer, read_gguf_tokenizer_metadata
from jaxserve.loader.gguf_tokenizer import PRE_TOKENIZER_SPLITS, build_gguf_tokenizer

pytestmark = pytest.mark.slow  # needs the real default model's vocabulary

CORPUS = [
    "",
    "Hello world! The capital of France is Paris.",
    "I'm sure you'll see it's THEIR car, isn't it? We've, they'd, I'LL.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "emoji: 🤗🚀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 \u05e9\u05c1\u05b8 \u0645\u064e",
    "def f(x):\n\tif x > 0:\n\t\treturn x ** 2  # square\n    return {'a': [1, 2.5, -3e10]}\n",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    'int main() { printf("%d\\n", 42); return 0; }',
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\nnew\n\n\nlines\r\nwindows\r\n\r\n",
    "runs:" + " " * 17 + "x" + "\n" * 5 + "y" + "\t" * 3 + "z",
    "digits 0 12 123 1234 12345 123456789 3.14159 1,000,000 +1-555-0100 2026-12-01",
    "mixed1234abc 1st 2nd 3rd 4th ½ ² ٣ ௫",
    "Ω≈ç√∫˜µ≤≥÷ åß∂ƒ©˙∆˚¬… ¡™£¢∞§¶•ªº–≠",
    "\u00a0non-breaking\u2009thin\u200bzero-width\ufeffbom",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "<|endoftext|><|endoftext|>text<|im_end|>more",
    "almost special: <|im_start <|im_end | <|endoftext",
]

QWEN2_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{%- else %}You are a helpful assistant.{%- endif %}\n\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and (loop.first and tools) %}"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}{%- endif %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
QWEN2_USER_DEFINED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
# A control token spelled outside the byte alphabet: a llama.cpp mislabel both builders leave out.
QWEN2_MISLABELLED = "<｜begin▁of▁sentence｜>"

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "日本の首都は？ 🗾"},
        {"role": "assistant", "content": "東京"},
        {"role": "user", "content": "  and   spaces\tand\ttabs\n\n"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": '{"temp_c": 21}'},
]


def write_qwen2_tokenizer_gguf(path: str, source_gguf: str) -> None:
    """A tokenizer-only ``qwen2`` GGUF as llama.cpp writes Qwen2's: byte-level BPE split by the
    ``qwen2`` regex, <|endoftext|> as BOS and padding, <|im_end|> as EOS, tool/think tokens
    user-defined, no BOS added."""
    meta = read_gguf_tokenizer_metadata(source_gguf)
    tokens = [*meta.tokens, *QWEN2_USER_DEFINED, QWEN2_MISLABELLED]
    types = [
        *meta.token_types,
        *[gguf.TokenType.USER_DEFINED] * len(QWEN2_USER_DEFINED),
        gguf.TokenType.CONTROL,
    ]
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(meta.merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(QWEN2_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=["llama-smollm2", "qwen2"])
def gguf_tokenizer_file(request, default_gguf, tmp_path_factory) -> str:
    if request.param == "llama-smollm2":
        return default_gguf
    path = str(tmp_path_factory.mktemp("qwen2-tok") / "qwen2.gguf")
    write_qwen2_tokenizer_gguf(path, default_gguf)
    return path


@pytest.fixture(scope="module")
def tokenizers(gguf_tokenizer_file):
    """(ours built from the metadata, transformers' GGUF tokenizer) for one file."""
    from transformers import PreTrainedTokenizerFast

    ours = build_gguf_tokenizer(read_gguf_tokenizer_metadata(gguf_tokenizer_file))
    model_dir, file_name = os.path.split(gguf_tokenizer_file)
    reference = PreTrainedTokenizerFast.from_pretrained(model_dir, gguf_file=file_name)
    return ours, reference


def every_special_token(tokenizer) -> list[str]:
    added = tokenizer.backend_tokenizer.get_added_tokens_decoder()
    return sorted(token.content for token in added.values())


def test_corpus_ids_are_identical(tokenizers):
    ours, reference = tokenizers
    specials = every_special_token(reference)
    texts = [*CORPUS, "".join(specials), " ".join(f"a{s}b" for s in specials)]
    for text in texts:
        for add_special_tokens in (True, False):
            expected = reference.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, repr(text)


def test_decoding_is_identical(tokenizers):
    ours, reference = tokenizers
    for text in CORPUS:
        ids = reference.encode(text)
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids), repr(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )
    every_id = list(range(len(reference)))
    assert ours.convert_ids_to_tokens(every_id) == reference.convert_ids_to_tokens(every_id)


def test_special_tokens_and_flags_are_identical(tokenizers):
    ours, reference = tokenizers
    assert every_special_token(ours) == every_special_token(reference)
    assert len(ours) == len(reference)
    for name in (
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "bos_token_id",
        "eos_token_id",
        "all_special_ids",
    ):
        assert getattr(ours, name) == getattr(reference, name), name
    for name in ("add_bos_token", "add_eos_token"):
        assert getattr(ours, name, None) == getattr(reference, name, None), name


def test_chat_template_output_is_identical(tokenizers):
    ours, reference = tokenizers
    assert ours.chat_template == reference.chat_template
    for messages in CONVERSATIONS:
        for generation_prompt in (True, False):
            kwargs = {"tokenize": False, "add_generation_prompt": generation_prompt}
            text = ours.apply_chat_template(messages, **kwargs)
            assert text == reference.apply_chat_template(messages, **kwargs)
            assert ours.encode(text, add_special_tokens=False) == reference.encode(
                text, add_special_tokens=False
            )


def test_the_qwen2_file_takes_the_qwen2_paths(default_gguf, tmp_path):
    """The second family is not the first one again: its text splits by Qwen2's regex, its tool tokens
    stay whole without being special, and its template renders tools."""
    path = str(tmp_path / "qwen2.gguf")
    write_qwen2_tokenizer_gguf(path, default_gguf)
    meta = read_gguf_tokenizer_metadata(path)
    assert meta.pre == "qwen2" and meta.pre in PRE_TOKENIZER_SPLITS
    qwen2, smollm2 = load_gguf_tokenizer(path), load_gguf_tokenizer(default_gguf)

    def pieces(tokenizer, text: str) -> list[str]:
        return [piece for piece, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]

    assert pieces(qwen2, "IT'S (x) 123") == ["IT", "'S", "Ġ(", "x", ")", "Ġ", "1", "2", "3"]
    assert pieces(smollm2, "IT'S (x) 123") == ["IT", "'", "S", "Ġ(", "x", ")", "Ġ123"]
    ids = qwen2.encode("<tool_call>x</tool_call>", add_special_tokens=False)
    assert qwen2.convert_ids_to_tokens(ids)[0] == "<tool_call>"
    assert qwen2.decode(ids, skip_special_tokens=True).startswith("<tool_call>")
    assert QWEN2_MISLABELLED not in qwen2.get_vocab()
    rendered = qwen2.apply_chat_template(
        TOOL_CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert '"name": "get_weather"' in rendered and "<tool_response>" in rendered


def test_tool_calling_template_renders_identically(default_gguf, tmp_path):
    from transformers import PreTrainedTokenizerFast

    path = str(tmp_path / "qwen2.gguf")
    write_qwen2_tokenizer_gguf(path, default_gguf)
    ours = load_gguf_tokenizer(path)
    reference = PreTrainedTokenizerFast.from_pretrained(str(tmp_path), gguf_file="qwen2.gguf")
    kwargs = {"tools": TOOLS, "tokenize": False, "add_generation_prompt": True}
    assert ours.apply_chat_template(TOOL_CONVERSATION, **kwargs) == reference.apply_chat_template(
        TOOL_CONVERSATION, **kwargs
    )
