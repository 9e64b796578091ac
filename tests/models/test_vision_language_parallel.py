"""Tiny vision-language models on 8 fake CPU devices: transformers' greedy tokens for image
prompts with tensor parallelism 2 (the encoder's heads and MLP split over the devices like the
decoder's) and 4 (the encoders' 2 heads do not split four ways: each device holds the whole
encoder), and with 2 pipeline stages x 2 (the decoder's layers staged, the encoder beside them),
for Idefics3 (tiles), Qwen2-VL (patches and M-RoPE positions) and Qwen2.5-VL (windows).

The device count is fixed when JAX starts, so the engines run in one fresh subprocess."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from reference_checks import qwen_vl_reference
from tiny_models import make_idefics3_checkpoint, make_qwen2_vl_checkpoint, run_on_fake_devices

torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402

SIZES = [(40, 70), (90, 50)]  # Idefics3: 2x3 and 3x2 tiles and their global ones
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = {
    "idefics3": ["Look <image> and tell", "A <image> B"],
    "qwen2_vl": [f"Look {QWEN_IMAGE} and tell", f"A {QWEN_IMAGE} B"],
}
PROMPTS["qwen2_5_vl"] = PROMPTS["qwen2_vl"]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from PIL import Image
    from tiny_models import engine_kwargs
    from jaxserve import LLM, SamplingParams

    paths, sizes, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
    images = [Image.fromarray(np.random.RandomState(i).randint(0, 256, (h, w, 3), np.uint8))
              for i, (h, w) in enumerate(sizes)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    report = {}
    for family, path in paths.items():
        requests = [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts[family], images)]
        for tp, pp in ((2, 1), (4, 1), (2, 2)):
            llm = LLM(path, **engine_kwargs(tensor_parallel_size=tp, pipeline_parallel_size=pp))
            q = dict(llm.llm_engine.runner.state.flat_state())[("vision", "q_kernel")].value
            report[f"{family} {tp}x{pp}"] = {
                "tokens": [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)],
                "q_shard": sorted({tuple(s.data.shape) for s in q.addressable_shards}),
            }
            del llm
    print(json.dumps(report))
    """
)


def _idefics3_reference(path, images) -> list[list[int]]:
    model, processor = make_idefics3_checkpoint(path)
    expected = []
    for image, prompt in zip(images, PROMPTS["idefics3"], strict=True):
        inputs = processor(text=[prompt], images=[[image]], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return expected


def _qwen_reference(path, images, family: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    model, image_processor = make_qwen2_vl_checkpoint(path, family=family)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = PROMPTS["qwen2_vl"]
    return [
        qwen_vl_reference(model, image_processor, tokenizer, p, [im], 8)[1] for p, im in zip(prompts, images)
    ]


def test_image_prompts_under_tensor_and_pipeline_parallelism(tmp_path):
    images = [
        Image.fromarray(np.random.RandomState(i).randint(0, 256, (h, w, 3), np.uint8))
        for i, (h, w) in enumerate(SIZES)
    ]
    paths = {name: tmp_path / name for name in ("idefics3", "qwen2_vl", "qwen2_5_vl")}
    expected = {"idefics3": _idefics3_reference(paths["idefics3"], images)}
    expected["qwen2_vl"] = _qwen_reference(paths["qwen2_vl"], images, "Qwen2VL")
    expected["qwen2_5_vl"] = _qwen_reference(paths["qwen2_5_vl"], images, "Qwen2_5_VL")
    paths = {k: str(v) for k, v in paths.items()}
    out = run_on_fake_devices(SCRIPT, json.dumps(paths), json.dumps(SIZES), json.dumps(PROMPTS))
    report = json.loads(out.strip().splitlines()[-1])
    width = 32  # every encoder: 32 wide, 2 heads (2 layers, Qwen2.5-VL's 3)
    for family in paths:
        layers = 3 if family == "qwen2_5_vl" else 2
        assert report[f"{family} 2x1"]["q_shard"] == [[layers, width, width // 2]]  # heads split two ways
        assert report[f"{family} 4x1"]["q_shard"] == [[layers, width, width]]  # 2 heads: whole on each device
        assert report[f"{family} 2x2"]["q_shard"] == [[layers, width, width // 2]]
        for layout in ("2x1", "4x1", "2x2"):
            assert report[f"{family} {layout}"]["tokens"] == expected[family], (family, layout)
