"""The engine with a Pallas kernel (interpreted, as on CPU it must be) in place of the
reference attention: the same greedy tokens on a tiny Llama, over a batch that mixes
prefill chunks and decodes."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import engine_kwargs

from jaxserve import LLM, SamplingParams


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["pallas-gpu-interpret", "pallas-tpu-interpret"])
def test_greedy_tokens_equal_the_reference_backends(tiny_llama_gqa, backend):
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, size=n).tolist()} for n in (5, 21, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = engine_kwargs(max_num_batched_tokens=32)  # the 40-token prompt is chunked
    want = [
        o.outputs[0].token_ids for o in LLM(tiny_llama_gqa[0], **kw).generate(prompts, params, use_tqdm=False)
    ]
    llm = LLM(tiny_llama_gqa[0], attention_backend=backend, **kw)
    assert llm.llm_engine.config.compilation_config.attention_backend == backend.removeprefix("pallas-")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
