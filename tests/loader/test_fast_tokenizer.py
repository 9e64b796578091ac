"""FastTokenizer (no transformers) against transformers' fast tokenizer around the same backend.

The GGUF tests compare whole builds; here the backend is shared, so every difference would be the
wrapper's: chat-template rendering (continue_final_message, content lists, reasoning fields, tools,
documents, special tokens as variables, jinja extensions), decoding flags, token conversions, and
the files it saves, which transformers' AutoTokenizer must read back to the same tokenizer.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from jaxserve.loader.fast_tokenizer import FastTokenizer
from jaxserve.loader.gguf import load_gguf_tokenizer

pytestmark = pytest.mark.slow  # the real default model's vocabulary

# Exercises what templates in the wild use: the named special tokens, loop controls, namespace,
# tojson with arguments, tools and documents, content lists, reasoning, raise_exception, and the
# {% generation %} block of training templates.
TEMPLATE = (
    "{{ bos_token }}{%- set ns = namespace(n=0) %}"
    "{%- if tools %}[TOOLS]{{ tools | tojson(indent=1) }}[/TOOLS]\n{%- endif %}"
    "{%- if documents %}{%- for d in documents %}[DOC {{ d.title }}]{{ d.text }}\n{%- endfor %}{%- endif %}"
    "{%- for m in messages %}{%- set ns.n = ns.n + 1 %}"
    "{%- if m.role == 'skip' %}{%- continue %}{%- endif %}"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + m.role) }}{%- endif %}"
    "<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{%- endif %}"
    "{%- if m.content is string %}{{ m.content }}"
    "{%- else %}{%- for part in m.content %}{{ part.text }}{%- endfor %}{%- endif %}"
    "{%- if m.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{%- endif %}"
    "<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    "{{ '(' ~ ns.n ~ ' ' ~ (extra | default('-')) ~ ')' }}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hi 🤗"}],
    [
        {"role": "system", "content": "Be brief.", "name": None},
        {"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}]},
        {"role": "skip", "content": "never shown"},
        {"role": "assistant", "content": "three", "reasoning": "counting"},
        {"role": "user", "content": "  trailing spaces  "},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
DOCUMENTS = [{"title": "Paris", "text": "Capital of France."}]


@pytest.fixture(scope="module")
def pair(default_gguf):
    """(ours, transformers' PreTrainedTokenizerFast) around copies of one backend."""
    from transformers import PreTrainedTokenizerFast

    ours = load_gguf_tokenizer(default_gguf)
    reference = PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(ours.backend_tokenizer),
        **ours.special_tokens_map,
        chat_template=ours.chat_template,
    )
    return ours, reference


def render_both(pair, conversation, **kwargs):
    ours, reference = pair
    return ours.apply_chat_template(conversation, **kwargs), reference.apply_chat_template(
        conversation, **kwargs
    )


@pytest.mark.parametrize(
    "template, conversation",
    [(None, CONVERSATIONS[0]), (TEMPLATE, CONVERSATIONS[0]), (TEMPLATE, CONVERSATIONS[1])],
    ids=["model", "features-one", "features-many"],  # the model's own template needs string contents
)
def test_chat_templates_render_identically(pair, template, conversation):
    for kwargs in (
        {"add_generation_prompt": True},
        {"add_generation_prompt": False},
        {"tools": TOOLS, "documents": DOCUMENTS, "extra": "x"},
    ):
        ours, reference = render_both(pair, conversation, chat_template=template, tokenize=False, **kwargs)
        assert ours == reference, kwargs
    ours, reference = render_both(
        pair, conversation, chat_template=template, tokenize=True, return_dict=False
    )
    assert ours == reference
    ours, reference = render_both(pair, conversation, chat_template=template, tokenize=True)
    assert ours["input_ids"] == list(reference["input_ids"])


@pytest.mark.parametrize("template", [None, TEMPLATE], ids=["model", "features"])
def test_continue_final_message_cuts_where_transformers_cuts(pair, template):
    finals = ["The capital is", "ends with a space "]
    if template is not None:  # the model's own template needs string contents
        finals.append([{"type": "text", "text": "in parts"}])
    for final in finals:
        conversation = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": final}]
        ours, reference = render_both(
            pair, conversation, chat_template=template, tokenize=False, continue_final_message=True
        )
        assert ours == reference
        assert not ours.rstrip().endswith("<|im_end|>")


def test_template_errors_are_value_errors_in_both(pair):
    import jinja2

    bad_role = [{"role": "robot", "content": "beep"}]
    for tokenizer in pair:
        with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role robot"):
            tokenizer.apply_chat_template(bad_role, chat_template=TEMPLATE, tokenize=False)
        with pytest.raises(ValueError, match="continue_final_message"):
            tokenizer.apply_chat_template(
                CONVERSATIONS[0], continue_final_message=True, add_generation_prompt=True, tokenize=False
            )


def test_a_template_cannot_reach_private_attributes(pair):
    import jinja2

    for tokenizer in pair:
        for escape in ("{% set n = namespace(_x=1) %}", "{{ messages.__class__.__mro__ }}"):
            with pytest.raises(jinja2.exceptions.SecurityError):
                tokenizer.apply_chat_template(CONVERSATIONS[0], chat_template=escape, tokenize=False)


def test_decoding_and_token_conversions_are_identical(pair):
    ours, reference = pair
    text = "<|im_start|>user\nCafé 日本 🤗 it's  two  spaces<|im_end|>\n"
    ids = reference.encode(text)
    assert ours.encode(text) == ids
    for skip in (False, True):
        for clean in (False, True):
            kwargs = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": clean}
            assert ours.decode(ids, **kwargs) == reference.decode(ids, **kwargs), kwargs
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == reference.convert_ids_to_tokens(
            ids, skip_special_tokens=skip
        )
    tokens = reference.convert_ids_to_tokens(ids)
    assert ours.convert_tokens_to_string(tokens) == reference.convert_tokens_to_string(tokens)
    assert ours.convert_tokens_to_ids(tokens) == reference.convert_tokens_to_ids(tokens)
    assert ours.decode(ids[3]) == reference.decode(ids[3])
    assert ours.convert_ids_to_tokens(ids[3]) == reference.convert_ids_to_tokens(ids[3])
    for name in ("vocab_size", "all_special_tokens", "all_special_ids", "special_tokens_map", "pad_token_id"):
        assert getattr(ours, name) == getattr(reference, name), name
    assert len(ours) == len(reference) and ours.get_vocab() == reference.get_vocab()


def test_saved_files_load_back_the_same_in_both(pair, tmp_path):
    from transformers import AutoTokenizer

    ours, _ = pair
    ours.save_pretrained(str(tmp_path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    again = FastTokenizer.from_directory(str(tmp_path))
    text = "<|im_start|>user\nSaved and loaded 🤗<|im_end|>"
    for other in (theirs, again):
        assert other.encode(text) == ours.encode(text)
        assert other.special_tokens_map == ours.special_tokens_map
        assert other.chat_template == ours.chat_template
        rendered = other.apply_chat_template(CONVERSATIONS[0], tokenize=False, add_generation_prompt=True)
        assert rendered == ours.apply_chat_template(
            CONVERSATIONS[0], tokenize=False, add_generation_prompt=True
        )


def test_loading_a_gguf_tokenizer_never_imports_transformers(default_gguf):
    code = (
        "import sys\n"
        "from jaxserve.loader.tokenizer import get_tokenizer\n"
        f"tok = get_tokenizer({default_gguf!r})\n"
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True)\n"
        "tok.decode(tok.encode('hello'))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
