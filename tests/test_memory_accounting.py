"""What the start-up log says about memory: the weights in all and on the fullest device, the
KV pool's blocks and tokens, and the concurrency they allow. How the pool is sized is tested
with the pool, in runner/test_kv_cache.py."""

from __future__ import annotations

import logging
import re

import jax
import pytest
from tiny_models import engine_kwargs

from jaxserve import LLM


def test_start_up_log_gives_weights_kv_tokens_and_concurrency(tiny_llama_gqa, caplog):
    caplog.set_level(logging.INFO, logger="jaxserve")
    llm = LLM(tiny_llama_gqa[0], **engine_kwargs(num_gpu_blocks_override=40, max_model_len=96))
    log = "\n".join(r.getMessage() for r in caplog.records)
    runner = llm.llm_engine.runner
    weights = sum(x.nbytes for x in jax.tree.leaves(runner.state))
    m = re.search(r"([\d.]+) MiB in all, ([\d.]+) MiB on the fullest of 1 devices", log)
    assert m and float(m.group(1)) == pytest.approx(weights / 2**20, abs=0.1) and m.group(1) == m.group(2)
    assert "KV cache: 40 blocks of 8 tokens" in log
    tokens = 39 * 8  # block 0 is never handed out
    assert (
        f"KV cache size: {tokens} tokens; maximum concurrency for 96 tokens per request: {tokens / 96:.2f}x"
        in log
    )
