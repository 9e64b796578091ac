"""Idefics3 / SmolVLM (a SigLIP encoder, pixel shuffle and projection before a Llama decoder)
against transformers on the same tiny random weights: image+text prompts through the offline
engine give transformers' logprobs and greedy tokens, with the prompt's image tokens split across
prefill chunks, several images per prompt, split and unsplit images, and images that must not
share prefix-cache pages or encoder rows with another image's."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import engine_kwargs, make_idefics3_checkpoint

torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402


def _image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), np.uint8))


IMAGES = {
    "wide": _image(0, 40, 70),
    "small": _image(1, 20, 20),
    "tall": _image(2, 90, 50),
    "square": _image(3, 64, 64),
}
# (prompt, images): a split image (2x3 tiles + the global one), two images, one image no larger
# than a tile (the global image only), and no image
CASES = [
    ("Look <image> and tell", ["wide"]),
    ("A <image> B <image> C", ["small", "tall"]),
    ("<image>", ["small"]),
    ("just text here", []),
]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3")
    model, processor = make_idefics3_checkpoint(path)
    llm = LLM(model=str(path), **engine_kwargs())  # a 64-token budget: image tokens span chunks
    return str(path), model, processor, llm


def _request(prompt: str, names: list[str]):
    return {"prompt": prompt, "multi_modal_data": {"image": [IMAGES[n] for n in names]}} if names else prompt


def _reference(model, processor, prompt: str, names: list[str], max_tokens: int):
    """transformers' greedy tokens and the first step's log-probabilities."""
    images = [[IMAGES[n] for n in names]] if names else None
    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    with torch.no_grad():
        first = torch.log_softmax(model(**inputs).logits[0, -1].double(), -1).numpy()
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist(), first


def test_image_prompts_match_transformers(vlm):
    _, model, processor, llm = vlm
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=5, ignore_eos=True)
    outs = llm.generate([_request(p, n) for p, n in CASES], params, use_tqdm=False)
    for (prompt, names), out in zip(CASES, outs, strict=True):
        tokens, first = _reference(model, processor, prompt, names, 10)
        images = [[IMAGES[n] for n in names]] if names else None
        assert list(out.prompt_token_ids) == processor(text=[prompt], images=images)["input_ids"][0]
        assert list(out.outputs[0].token_ids) == tokens, prompt
        for token, lp in out.outputs[0].logprobs[0].items():
            assert lp.logprob == pytest.approx(first[token], abs=2e-4), (prompt, token)
        assert out.prompt == prompt


def test_another_image_changes_the_answer_and_shares_nothing(vlm):
    """The same text with another image: transformers' logprobs for each, so neither the prefix
    cache (pages keyed by the images) nor the encoder's cache mixed the two up. The same image and
    text again is served from the prefix cache; the same image after other text is fed from the
    encoder's cache."""
    _, model, processor, llm = vlm
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    encoder = llm.llm_engine.runner.images
    results = []
    for prompt, names in [
        ("Describe <image> please", ["square"]),
        ("Describe <image> please", ["tall"]),
        ("Describe <image> please", ["square"]),
        ("Something else first, then <image> please", ["square"]),
    ]:
        hits, misses = encoder.hits, encoder.misses
        (out,) = llm.generate([_request(prompt, names)], params, use_tqdm=False)
        _, first = _reference(model, processor, prompt, names, 1)
        for token, lp in out.outputs[0].logprobs[0].items():
            assert lp.logprob == pytest.approx(first[token], abs=2e-4), (prompt, names)
        results.append(
            (out.outputs[0].logprobs[0], out.num_cached_tokens, encoder.hits - hits, encoder.misses - misses)
        )
    (
        (square, _, _, encoded),
        (tall, cached_tall, _, _),
        (again, cached, hits, misses),
        (_, _, hits_after, misses_after),
    ) = results
    assert encoded == 1 and cached_tall == 0  # pages are keyed by the images
    assert square.keys() != tall.keys() or any(square[t].logprob != tall[t].logprob for t in square)
    assert again.keys() == square.keys()
    assert all(again[t].logprob == pytest.approx(square[t].logprob, abs=1e-5) for t in square)
    assert cached > 0 and misses == 0
    assert hits_after >= 1 and misses_after == 0  # (one hit per chunk holding its rows)


def test_without_the_encoder_cache_images_are_encoded_again(vlm):
    """--disable-mm-preprocessor-cache: an image's rows live only while consecutive steps feed them
    (the chunks of one prompt); the same image later is encoded again, with the same result."""
    path, model, processor, _ = vlm
    llm = LLM(model=path, disable_mm_preprocessor_cache=True, **engine_kwargs(enable_prefix_caching=False))
    encoder = llm.llm_engine.runner.images
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = "Some words before the picture <image>"  # the image's rows at 27..69: two chunks
    for names, misses, hits in ((["wide"], 1, 1), (["tall"], 2, 2), (["wide"], 3, 3)):
        (out,) = llm.generate([_request(prompt, names)], params, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == _reference(model, processor, prompt, names, 6)[0]
        assert (encoder.misses, encoder.hits) == (misses, hits), names


@pytest.mark.parametrize(
    "prompt, message",
    [
        (
            {"prompt": "no placeholder", "multi_modal_data": {"image": IMAGES["small"]}},
            "0 <image> placeholder",
        ),
        (
            {"prompt": "<image><image>", "multi_modal_data": {"image": [IMAGES["small"]]}},
            "2 <image> placeholder",
        ),
        ({"prompt": "<image>", "multi_modal_data": {"image": "not an image"}}, "must be PIL images"),
        ({"prompt": "<image>", "multi_modal_data": {"audio": [1.0]}}, "only 'image'"),
        (
            {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": IMAGES["small"]}},
            "0 <image> placeholder",
        ),
    ],
)
def test_bad_image_prompts_are_refused(vlm, prompt, message):
    llm = vlm[3]
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    (out,) = llm.generate(["still serving"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_a_prompt_of_token_ids_takes_images_too(vlm):
    """The placeholder given as its token id: expanded the same as in a text prompt."""
    llm = vlm[3]
    prompt, names = CASES[1]
    ids = llm.get_tokenizer().encode(prompt)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    by_text, by_ids = llm.generate(
        [
            _request(prompt, names),
            {"prompt_token_ids": ids, "multi_modal_data": {"image": [IMAGES[n] for n in names]}},
        ],
        params,
        use_tqdm=False,
    )
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_a_started_engine_compiles_nothing_for_images(vlm):
    """Start-up compiles the encoder and each bucket's step with image rows: image requests of
    several sizes, chunked and batched with text, then compile nothing."""
    from reference_checks import compilations

    path, model, processor, _ = vlm
    kwargs = engine_kwargs(enforce_eager=False)
    llm = LLM(model=path, **kwargs)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with compilations() as compiles:
        outs = llm.generate([_request(p, n) for p, n in CASES], params, use_tqdm=False)
    assert compiles == []
    assert list(outs[1].outputs[0].token_ids) == _reference(model, processor, *CASES[1], 3)[0]


def test_chat_takes_pil_images_and_image_urls(vlm, tmp_path):
    """LLM.chat: an image_pil part and a data: URL of the same picture give the answer the same
    conversation gets through transformers' template and processor."""
    import base64
    import io

    _, model, processor, llm = vlm
    buf = io.BytesIO()
    IMAGES["wide"].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    question = {"type": "text", "text": "What is it?"}
    conversations = [
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": IMAGES["wide"]}, question]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, question]}],
    ]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.chat(conversations, params, use_tqdm=False)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, question]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = processor(text=[text], images=[[IMAGES["wide"]]], return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=6, do_sample=False)[
            0, inputs["input_ids"].shape[1] :
        ]
    for out in outs:
        assert list(out.prompt_token_ids) == inputs["input_ids"][0].tolist()
        assert list(out.outputs[0].token_ids) == expected.tolist()


def test_mm_processor_kwargs_reach_the_image_processor(vlm):
    """--mm-processor-kwargs {"do_image_splitting": false}: one tile a picture, as transformers'
    processor with the same setting makes it, and its answer."""
    import transformers
    from tiny_models import TINY_IDEFICS3_PREPROCESSOR
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    path, model, processor, _ = vlm
    llm = LLM(model=path, mm_processor_kwargs={"do_image_splitting": False}, **engine_kwargs())
    settings = {k: v for k, v in TINY_IDEFICS3_PREPROCESSOR.items() if k != "image_processor_type"}
    unsplit = transformers.Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(**settings | {"do_image_splitting": False}),
        tokenizer=processor.tokenizer,
        image_seq_len=4,
    )
    prompt, names = CASES[0]
    (out,) = llm.generate(
        [_request(prompt, names)],
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    expected, _ = _reference(model, unsplit, prompt, names, 5)
    assert (
        list(out.prompt_token_ids)
        == unsplit(text=[prompt], images=[[IMAGES[n] for n in names]])["input_ids"][0]
    )
    assert out.prompt_token_ids.count(processor.tokenizer.convert_tokens_to_ids("<image>")) == 4  # one tile
    assert list(out.outputs[0].token_ids) == expected
    with pytest.raises(ValueError, match="do_image_split"):  # refused at start-up
        LLM(model=path, mm_processor_kwargs={"do_image_split": False}, **engine_kwargs())
