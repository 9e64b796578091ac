"""SmolVLM-256M-Instruct's shapes (no SmolVLM weights come from the package index): SmolLM2-135M's
widths (576 wide, 9 heads over 3 KV heads, a 49280-token vocabulary) behind a SigLIP 768 wide
with 12 heads over 512x512 tiles of 16x16 patches, a pixel shuffle of 4 (64 tokens a tile), and
SmolVLM's image processor with the long side to 1024 (512 tiles: a 200x300 picture is 2x2 tiles
and the global one, 320 image tokens). Two of each stack's layers, since every layer runs the same
program. Random weights against transformers: the first token's logprobs and greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import engine_kwargs, make_idefics3_checkpoint

torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402

TEXT = dict(
    vocab_size=49280, hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
    num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
)  # fmt: skip
VISION = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12, image_size=512,
    patch_size=16,
)  # fmt: skip
# (SmolVLM's processor takes the long side to 2048; 1024 here keeps the test short: 2x2 tiles)
PREPROCESSOR = {"size": {"longest_edge": 1024}, "max_image_size": {"longest_edge": 512}}


def test_smolvlm_256m_shapes_match_transformers(tmp_path):
    model, processor = make_idefics3_checkpoint(
        tmp_path, text=TEXT, vision=VISION, preprocessor=PREPROCESSOR, scale_factor=4
    )
    image = Image.fromarray(np.random.RandomState(0).randint(0, 256, (300, 200, 3), np.uint8))
    prompt = "User:<image>What do you see?<end_of_utterance>\nAssistant:"
    inputs = processor(text=[prompt], images=[[image]], return_tensors="pt")
    assert (inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<image>")).sum() == 5 * 64
    with torch.no_grad():
        generated = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    first = torch.log_softmax(generated.logits[0][0].double(), -1).numpy()
    expected = generated.sequences[0, inputs["input_ids"].shape[1] :]
    kwargs = engine_kwargs(max_num_batched_tokens=512, max_model_len=512)
    llm = LLM(str(tmp_path), **kwargs)
    (out,) = llm.generate(
        [{"prompt": prompt, "multi_modal_data": {"image": image}}],
        SamplingParams(max_tokens=4, temperature=0, logprobs=5, ignore_eos=True),
        use_tqdm=False,
    )
    assert list(out.prompt_token_ids) == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == expected.tolist()
    for token, lp in out.outputs[0].logprobs[0].items():
        assert lp.logprob == pytest.approx(first[token], abs=2e-4)
