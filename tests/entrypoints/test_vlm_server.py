"""Chat completions with images (OpenAI's image_url parts) on a tiny Idefics3: through the OpenAI
SDK, whole and streamed, from data: and file:// URLs, the reply is transformers' greedy answer to
the same conversation (SmolVLM's chat template, transformers' processor); image and text requests
run side by side; bad images, URLs outside --allowed-local-media-path, too many images and images
sent to a text-only model are 400s with OpenAI error bodies, and the server keeps serving."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image
from server_inputs import start_server
from tiny_models import engine_kwargs, make_idefics3_checkpoint

from jaxserve.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine

torch = pytest.importorskip("torch")
MODEL = "tiny-vlm"
MAX_TOKENS = 8


def _png(seed: int, height: int, width: int) -> bytes:
    image = Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _messages(*urls: str, text: str = "What is in the picture?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3-server")
    media = tmp_path_factory.mktemp("media")
    model, processor = make_idefics3_checkpoint(path)
    args = EngineArgs(
        model=str(path),
        served_model_name=[MODEL],
        allowed_local_media_path=str(media),
        limit_mm_per_prompt={"image": 2},
        **engine_kwargs(),
    )
    return LLMEngine.from_engine_args(args), model, processor, media


@pytest.fixture
async def client(vlm):
    server = await start_server(vlm[0])
    yield openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
    await server.close()


def _reference(model, processor, messages: list[dict], pngs: list[bytes]) -> tuple[str, int]:
    """transformers' greedy reply to the conversation, and its prompt's length."""
    template_messages = [
        {**m, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
        for m in messages
    ]
    text = processor.tokenizer.apply_chat_template(
        template_messages, tokenize=False, add_generation_prompt=True
    )
    images = [[Image.open(io.BytesIO(p)) for p in pngs]]
    inputs = processor(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    # (a random model's last token may end inside a character: the server holds its bytes back)
    text = processor.tokenizer.decode(new, skip_special_tokens=True).rstrip("\ufffd")
    return text, inputs["input_ids"].shape[1]


async def test_chat_with_images_answers_as_transformers(client, vlm):
    _, model, processor, media = vlm
    pngs = [_png(0, 40, 70), _png(1, 20, 20)]
    (media / "two.png").write_bytes(pngs[1])
    cases = [
        ([_data_url(pngs[0])], pngs[:1]),
        ([_data_url(pngs[0]), f"file://{media / 'two.png'}"], pngs),
    ]
    for urls, used in cases:
        messages = _messages(*urls)
        text, prompt_len = _reference(model, processor, messages, used)
        whole = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert whole.choices[0].message.content == text
        assert whole.usage.prompt_tokens == prompt_len
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == text


async def test_image_and_text_requests_run_side_by_side(client, vlm):
    _, model, processor, _ = vlm
    png = _png(2, 90, 50)
    with_image = _messages(_data_url(png), text="Describe it")
    text_only = [{"role": "user", "content": "Just words"}]
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(model=MODEL, messages=m, max_tokens=MAX_TOKENS, temperature=0)
            for m in (with_image, text_only, with_image)
        )
    )
    expected = _reference(model, processor, with_image, [png])[0]
    assert replies[0].choices[0].message.content == replies[2].choices[0].message.content == expected
    assert replies[1].choices[0].message.content != expected


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot decode image"),
        ("ftp://example.com/a.png", "ftp"),
        ("file:///etc/hostname", "outside"),
        ("data:text/plain;base64,aGVsbG8=", "image"),
    ],
)
async def test_bad_images_are_400s(client, url, message):
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=_messages(url), max_tokens=2)
    assert message in str(err.value)
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "still there?"}], max_tokens=2
    )
    assert reply.choices[0].finish_reason == "length"


async def test_too_many_images_are_a_400(client):
    url = _data_url(_png(3, 20, 20))
    with pytest.raises(openai.BadRequestError, match="At most 2 image"):
        await client.chat.completions.create(model=MODEL, messages=_messages(url, url, url), max_tokens=2)


async def test_a_text_only_model_refuses_images(http):
    body = {"model": "tiny", "messages": _messages(_data_url(_png(4, 20, 20))), "max_tokens": 2}
    session, base = http
    async with session.post(base + "v1/chat/completions", json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert "takes no images" in error["message"] and error["type"] == "BadRequestError"


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    from tiny_models import make_qwen2_vl_checkpoint

    path = tmp_path_factory.mktemp("qwen2-vl-server")
    model, image_processor = make_qwen2_vl_checkpoint(path)
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(path), served_model_name=[MODEL], **engine_kwargs())
    )
    return engine, model, image_processor


async def test_qwen2_vl_chat_with_an_image(qwen2_vl):
    """Qwen2-VL through the server: its template's vision tokens, the image's pad tokens and
    M-RoPE positions give transformers' reply, whole and streamed."""
    engine, model, image_processor = qwen2_vl
    png = _png(5, 50, 40)
    messages = _messages(_data_url(png))
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, messages[0]["content"][1]]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    pixels = image_processor(images=[Image.open(io.BytesIO(png))], return_tensors="pt")
    pad = "<|image_pad|>"
    text = text.replace(pad, pad * (int(pixels["image_grid_thw"].prod()) // image_processor.merge_size**2))
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(ids == tokenizer.convert_tokens_to_ids(pad)).int(),
            max_new_tokens=MAX_TOKENS, do_sample=False,
        )  # fmt: skip
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).rstrip("\ufffd")
    server = await start_server(engine)
    try:
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
        whole = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert whole.choices[0].message.content == expected
        assert whole.usage.prompt_tokens == ids.shape[1]
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == expected
    finally:
        await server.close()
