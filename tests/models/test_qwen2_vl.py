"""Qwen2-VL (a ViT with 2D rope and a patch merger before a Qwen2 decoder with M-RoPE) against
transformers on the same tiny random weights: image+text prompts through the offline engine and
LLM.chat give transformers' prompt tokens, logprobs and greedy tokens, with several images of
different grids in one prompt, text after them (positions that run ahead of the sequence's), image
tokens split across prefill chunks, and text-only prompts beside them."""

from __future__ import annotations

import numpy as np
import pytest
from reference_checks import qwen_vl_reference
from tiny_models import engine_kwargs, make_qwen2_vl_checkpoint

torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), np.uint8))


IMAGES = [_image(0, 40, 56), _image(1, 70, 30), _image(2, 9, 12)]
CASES = [
    (f"Look {PLACEHOLDER} and tell me more", [0]),
    (f"A {PLACEHOLDER} B {PLACEHOLDER} C", [1, 2]),
    ("only words", []),
]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-vl")
    model, image_processor = make_qwen2_vl_checkpoint(path)
    llm = LLM(model=str(path), **engine_kwargs())  # a 64-token budget: images span chunks
    return model, image_processor, llm


def test_image_prompts_match_transformers(vlm):
    model, image_processor, llm = vlm
    tokenizer = llm.get_tokenizer()
    requests = [
        {"prompt": p, "multi_modal_data": {"image": [IMAGES[i] for i in n]}} if n else p for p, n in CASES
    ]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True)
    outs = llm.generate(requests, params, use_tqdm=False)
    for (prompt, n), out in zip(CASES, outs, strict=True):
        ids, tokens, first = qwen_vl_reference(
            model, image_processor, tokenizer, prompt, [IMAGES[i] for i in n], 8
        )
        assert list(out.prompt_token_ids) == ids, prompt
        assert list(out.outputs[0].token_ids) == tokens, prompt
        for token, lp in out.outputs[0].logprobs[0].items():
            assert lp.logprob == pytest.approx(first[token], abs=2e-4), (prompt, token)


def test_chat_with_an_image(vlm):
    model, image_processor, llm = vlm
    question = {"type": "text", "text": "What is this?"}
    conversation = [{"role": "user", "content": [{"type": "image_pil", "image_pil": IMAGES[1]}, question]}]
    (out,) = llm.chat(
        [conversation], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False
    )
    text = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, question]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids, tokens, _ = qwen_vl_reference(model, image_processor, llm.get_tokenizer(), text, [IMAGES[1]], 6)
    assert list(out.prompt_token_ids) == ids
    assert list(out.outputs[0].token_ids) == tokens
