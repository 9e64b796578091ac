"""The serving benchmark against a real jaxserve server: every request succeeds and the
token counts it reports are the ones the server generated."""

from __future__ import annotations

from server_inputs import MODEL

from jaxserve.benchmarks.client import Target, fetch_model_id
from jaxserve.benchmarks.dataset import sample_random_requests
from jaxserve.benchmarks.serving import benchmark


async def test_benchmark_client_against_jaxserve(server, llm_engine):
    base = str(server.make_url("")).rstrip("/")
    assert await fetch_model_id(base) == MODEL
    requests = sample_random_requests(
        llm_engine.tokenizer, num_prompts=6, input_len=24, output_len=5, range_ratio=0.0, prefix_len=0, seed=0
    )
    for backend, path in (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")):
        target = Target(api_url=base + path, model=MODEL, backend=backend, ignore_eos=True)
        result = await benchmark(target, requests, max_concurrency=4, tokenizer=llm_engine.tokenizer)
        assert result["completed"] == 6 and not any(result["errors"])
        assert result["total_output_tokens"] == 6 * 5  # ignore_eos: exactly max_tokens each
        assert result["output_lens"] == [5] * 6
        assert all(t > 0 for t in result["ttfts"])
        assert result["mean_tpot_ms"] > 0 and result["output_throughput"] > 0
