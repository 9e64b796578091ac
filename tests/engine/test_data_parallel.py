"""Data parallelism: the router's choices, and replicas behind one AsyncLLMEngine giving the
outputs a single engine gives (two replicas sharing this process's one CPU device; the
4-device server run is in tests/entrypoints/test_data_parallel_server.py)."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import engine_kwargs

from jaxserve import LLM, SamplingParams
from jaxserve.args import EngineArgs
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.router import Router


def test_router_sends_new_prompts_to_the_least_loaded_replica():
    router = Router(3, block_size=4, capacity_blocks=100, slack=0)
    picks = [router.assign(list(range(i * 100, i * 100 + 9))) for i in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    router.release(1)
    router.release(1)
    assert router.assign([900, 901]) == 1  # now the emptiest


def test_router_follows_the_cached_prefix_within_the_slack():
    router = Router(2, block_size=4, capacity_blocks=100, slack=2)
    shared = list(range(50, 62))  # three full pages
    assert router.assign(shared + [1, 2]) == 0
    assert router.assign(shared + [3]) == 0  # its pages are on replica 0, one request more is within slack
    assert router.assign(shared + [4]) == 0
    assert router.assign(shared + [5]) == 1  # replica 0 is now 3 ahead: past the slack
    assert router.cached_pages(1, shared) == 3 and router.cached_pages(0, shared[:8] + [0] * 4) == 2
    # only full pages count, and equal pages after a different page are a different prefix
    assert router.cached_pages(0, shared[:3]) == 0
    assert router.cached_pages(0, [0, 0, 0, 0] + shared[4:]) == 0


def test_router_ties_go_to_the_emptier_kv_cache_and_memory_is_bounded():
    router = Router(2, block_size=2, capacity_blocks=3, slack=1)
    router.kv_usage = [0.8, 0.1]
    assert router.assign([1, 2, 3, 4]) == 1
    router.release(1)
    assert router.assign([1, 2, 3, 4, 5, 6, 7, 8]) == 1  # shares the first two pages
    # capacity 3: the deepest page fell out, the prefix before it is still known
    assert router.cached_pages(1, [1, 2, 3, 4, 5, 6, 7, 8]) == 3
    assert router.cached_pages(1, [1, 2, 3, 4]) == 2
    assert router.cached_pages(0, [1, 2, 3, 4]) == 0


@pytest.fixture(scope="module")
def replicas(tiny_llama_gqa):
    config = EngineArgs(model=tiny_llama_gqa[0], **engine_kwargs()).create_engine_config()
    first = LLMEngine(config)
    return [first, LLMEngine(config, first.tokenizer)]


def test_two_replicas_share_the_work_and_give_a_single_engines_outputs(tiny_llama_gqa, replicas):
    prompts = [[5 + i, 17, 300, 42 + i, 9] * (1 + i % 3) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    single = LLM(tiny_llama_gqa[0], **engine_kwargs()).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )

    async def serve():
        engine = AsyncLLMEngine(replicas)
        engine.start()
        try:

            async def one(i):
                async for out in engine.generate({"prompt_token_ids": prompts[i]}, params, f"r{i}"):
                    last = out
                return last

            return await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            engine.shutdown()

    outs = asyncio.run(serve())
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in single]
    served = [r.scheduler.prefix_cache_stats.queries for r in replicas]
    assert all(q > 0 for q in served), served  # both replicas ran requests
    assert sum(served) == sum(len(p) for p in prompts)
