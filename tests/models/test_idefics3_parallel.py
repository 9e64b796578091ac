"""A tiny Idefics3 on 8 fake CPU devices: transformers' greedy tokens for image prompts with
tensor parallelism 2 (the encoder's heads and MLP split over the devices like the decoder's) and
4 (its 2 heads do not split four ways: each device holds the whole encoder), and with 2 pipeline
stages x 2 (the decoder's layers staged, the encoder beside them).

The device count is fixed when JAX starts, so the engines run in one fresh subprocess."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from tiny_models import make_idefics3_checkpoint, run_on_fake_devices

torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402

SIZES = [(40, 70), (90, 50)]  # 2x3 and 3x2 tiles and their global ones
PROMPTS = ["Look <image> and tell", "A <image> B"]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from PIL import Image
    from tiny_models import engine_kwargs
    from jaxserve import LLM, SamplingParams

    path, sizes, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    images = [Image.fromarray(np.random.RandomState(i).randint(0, 256, (h, w, 3), np.uint8))
              for i, (h, w) in enumerate(sizes)]
    requests = [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    report = {}
    for tp, pp in ((2, 1), (4, 1), (2, 2)):
        llm = LLM(path, **engine_kwargs(tensor_parallel_size=tp, pipeline_parallel_size=pp))
        q = dict(llm.llm_engine.runner.state.flat_state())[("vision", "q_kernel")].value
        report[f"{tp}x{pp}"] = {
            "tokens": [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)],
            "q_shard": sorted({tuple(s.data.shape) for s in q.addressable_shards}),
        }
        del llm
    print(json.dumps(report))
    """
)


def test_image_prompts_under_tensor_and_pipeline_parallelism(tmp_path):
    model, processor = make_idefics3_checkpoint(tmp_path)
    expected = []
    for i, ((h, w), prompt) in enumerate(zip(SIZES, PROMPTS, strict=True)):
        image = Image.fromarray(np.random.RandomState(i).randint(0, 256, (h, w, 3), np.uint8))
        inputs = processor(text=[prompt], images=[[image]], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    out = run_on_fake_devices(SCRIPT, str(tmp_path), json.dumps(SIZES), json.dumps(PROMPTS))
    report = json.loads(out.strip().splitlines()[-1])
    layers, hidden = 2, 32
    assert report["2x1"]["q_shard"] == [[layers, hidden, hidden // 2]]  # heads split two ways
    assert report["4x1"]["q_shard"] == [[layers, hidden, hidden]]  # 2 heads: whole on each device
    assert report["2x2"]["q_shard"] == [[layers, hidden, hidden // 2]]
    for layout, result in report.items():
        assert result["tokens"] == expected, layout
