"""Fixtures for the host-side engine tests: requests, a fake model, a step loop, tokenizers.

Nothing here imports jax: the scheduler is driven by FakeModel (tests/fakes.py), which stands in
for the runner and whose outputs depend only on each request's prompt, so any schedule
(chunked, preempted, cached, overlapped) must produce the same outputs.

run_to_completion(overlap=True) drives the scheduler as the asynchronous engine does: step N+1
is scheduled and run before step N's tokens are handed back, and FakeModel feeds a row's pending
token from its own previous answer, as the device does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from fakes import EOS, FakeModel

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler_output import SchedulerOutput


def check_accounting(scheduler: Scheduler) -> None:
    """Every live request is in exactly one queue, and page ref counts match the tables."""
    waiting = [r.request_id for r in scheduler.waiting]
    running = [r.request_id for r in scheduler.running]
    assert len(set(waiting)) == len(waiting) and len(set(running)) == len(running)
    assert not set(waiting) & set(running)
    assert set(waiting) | set(running) == set(scheduler.requests)
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    bm = scheduler.block_manager
    refs = [0] * bm.num_blocks
    for req_id in scheduler.requests:
        if req_id not in running:
            assert bm.block_ids(req_id) == [], "a waiting request holds no pages"
        for block in bm.block_ids(req_id):
            refs[block] += 1
    assert refs[0] == 0
    assert all(bm.ref_count(b) == refs[b] for b in range(1, bm.num_blocks))
    assert bm.num_free_blocks == sum(1 for b in range(1, bm.num_blocks) if refs[b] == 0)


def run_to_completion(
    scheduler: Scheduler, model: FakeModel | None = None, max_steps: int = 10_000, overlap: bool = False
) -> list[SchedulerOutput]:
    """Step until every request finishes, checking the budget and accounting each step.
    overlap: update each step only after the next one is scheduled and run (asynchronous
    scheduling); a step may then schedule nothing while every request waits for its token."""
    model = model or FakeModel(scheduler)
    outputs = []
    in_flight = None
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and in_flight is None:
            break
        out = scheduler.schedule()
        assert out.num_tokens <= scheduler.config.max_num_batched_tokens
        assert len(out.seqs) <= scheduler.config.max_num_seqs
        assert not out.is_empty or in_flight is not None, "a step with unfinished requests scheduled nothing"
        answer = model(out) if not out.is_empty else None
        if in_flight is not None:
            scheduler.update(*in_flight)
        in_flight = (out, answer) if answer is not None else None
        if not overlap and in_flight is not None:
            scheduler.update(*in_flight)
            in_flight = None
        check_accounting(scheduler)
        if not out.is_empty:
            outputs.append(out)
    else:
        raise AssertionError("requests did not finish")
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    return outputs


@pytest.fixture
def fake_model() -> type[FakeModel]:
    return FakeModel


@pytest.fixture
def run() -> Callable[..., list[SchedulerOutput]]:
    return run_to_completion


@pytest.fixture
def accounting() -> Callable[[Scheduler], None]:
    return check_accounting


@pytest.fixture
def make_scheduler() -> Callable[..., Scheduler]:
    def make(
        num_blocks: int = 64,
        block_size: int = 4,
        enable_prefix_caching: bool = False,
        hash_algo: str = "builtin",
        **scheduler_kwargs,
    ) -> Scheduler:
        scheduler_kwargs.setdefault("max_model_len", 256)
        cache = CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=hash_algo,
        )
        return Scheduler(SchedulerConfig(**scheduler_kwargs), cache, num_blocks)

    return make


@pytest.fixture
def make_request() -> Callable[..., Request]:
    ids = itertools.count()
    clock = itertools.count()

    def make(
        prompt: int | list[int] = 8,
        *,
        max_tokens: int = 4,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        **params,
    ) -> Request:
        n = next(ids)
        if isinstance(prompt, int):  # a prompt of that length, distinct per request
            prompt = [2 + (n * 7919 + i * 31) % 90 for i in range(prompt)]
        return Request(
            request_id or f"req-{n}",
            prompt,
            SamplingParams(max_tokens=max_tokens, **params),
            seed=1000 + n,
            eos_token_id=EOS,
            priority=priority,
            arrival_time=float(next(clock)) if arrival_time is None else arrival_time,
            max_tokens=max_tokens,
        )

    return make


# ---- tokenizers for the detokenizer tests ------------------------------------------------

CORPUS = [
    "Hello world, this is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, déjà vu, naïve résumé.",
    "日本語のテキストと日本の文化。",
    "Emoji time 😀 🎉 🚀 party!",
    "Stop here. STOP! Then continue.",
]


def _train(tokenizer, pre_tokenizer, decoder, alphabet):
    from tokenizers import trainers

    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoder
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    return tokenizer


@pytest.fixture(scope="session")
def byte_tokenizer():
    """GPT-2 style byte-level BPE (SmolLM2's kind): characters outside the learned merges
    split into byte tokens, so partial UTF-8 sequences really occur."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = _train(
        Tokenizer(models.BPE()),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
        pre_tokenizers.ByteLevel.alphabet(),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="session")
def metaspace_tokenizer():
    """SentencePiece style (Llama's kind): a leading "▁" decodes to a space except at the
    start of the decoded string, so decoding a window must keep left context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(set("".join(CORPUS)) | {"▁"})
    tok = _train(
        Tokenizer(models.BPE(unk_token="<|endoftext|>")),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"),
        decoders.Metaspace(replacement="▁", prepend_scheme="always"),
        alphabet,
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
