"""Pooling models (embeddings) against transformers: a decoder served with --runner pooling, and
a base-model checkpoint (no LM head) with sentence-transformers files, each pooled LAST, MEAN or
CLS over the final hidden states transformers calls last_hidden_state; chunked prompts,
preemption and both schedulings give the same vectors; bad requests are refused."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
from reference_checks import assert_vectors_close, classifier_logits, pooled_reference
from tiny_models import (
    TINY_LLAMA,
    engine_kwargs,
    make_classifier,
    make_encoder_checkpoint,
    make_family_checkpoint,
    make_lora_adapter,
    make_modernbert,
    make_tokenizer,
    make_wordpiece_tokenizer,
)

from jaxserve import LLM
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany. " * 3,
    "hi",
    "JAX compiles numerical programs with XLA for TPUs, GPUs and CPUs. " * 2,
]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3ForCausalLM: (path, the torch base model whose last_hidden_state is pooled)."""
    path = tmp_path_factory.mktemp("qwen3_embed")
    return str(path), make_family_checkpoint(path, "qwen3").model


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_transformers(qwen3, pooling_type):
    path, base = qwen3
    llm = LLM(path, runner="pooling", **engine_kwargs(pooler_config={"pooling_type": pooling_type}))
    tok = llm.get_tokenizer()
    outs = llm.embed(PROMPTS, use_tqdm=False)
    raw = llm.encode(PROMPTS, PoolingParams(normalize=False), use_tqdm=False)
    for prompt, out, unnormalized in zip(PROMPTS, outs, raw):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids and out.finished
        assert_vectors_close(out.outputs.embedding, pooled_reference(base, ids, pooling_type))
        assert isinstance(unnormalized.outputs.data, np.ndarray)
        assert_vectors_close(
            unnormalized.outputs.data, pooled_reference(base, ids, pooling_type, normalize=False)
        )


def test_all_pooling_gives_every_tokens_vector(qwen3):
    """ALL: each prompt's tokens' final hidden states, each normalized (through chunks of 16 and
    a preemption); a request for one vector per prompt is refused."""
    path, base = qwen3
    kw = engine_kwargs(
        max_num_batched_tokens=16, num_gpu_blocks_override=9, pooler_config={"pooling_type": "ALL"}
    )
    llm = LLM(path, runner="pooling", **kw)
    tok = llm.get_tokenizer()
    prompts = [PROMPTS[0] * 4, PROMPTS[1], PROMPTS[3] * 2]
    for prompt, out in zip(prompts, llm.encode(prompts, use_tqdm=False)):
        ids = tok.encode(prompt)
        with torch.no_grad():
            hidden = base(torch.tensor([ids])).last_hidden_state[0].double().numpy()
        want = hidden / np.linalg.norm(hidden, axis=-1, keepdims=True)
        assert out.outputs.data.shape == (len(ids), hidden.shape[1])
        np.testing.assert_allclose(out.outputs.data, want, atol=2e-5)
    with pytest.raises(ValueError, match="pools ALL \\(a vector per token\\)"):
        llm.embed(PROMPTS[0], use_tqdm=False)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_chunked_and_preempted_prompts_pool_the_same(qwen3, async_scheduling):
    """Prompts of 28-56 tokens in steps of 16 (chunks of every size) in a pool of 8 pages of 8 tokens
    (so requests are preempted mid-prompt and recompute): MEAN sums across the chunks, CLS keeps
    the first, LAST the last, and the vectors are transformers' all the same."""
    path, base = qwen3
    prompts = [PROMPTS[0] * 4, PROMPTS[1], PROMPTS[3] * 2, PROMPTS[3], PROMPTS[0] * 5]  # 28-56 tokens
    for pooling_type in ("MEAN", "CLS", "LAST"):
        kw = engine_kwargs(
            max_num_batched_tokens=16,
            long_prefill_token_threshold=8,  # two prompts' chunks a step: more of them start
            num_gpu_blocks_override=9,
            async_scheduling=async_scheduling,
            pooler_config={"pooling_type": pooling_type},
        )
        llm = LLM(path, runner="pooling", **kw)
        tok = llm.get_tokenizer()
        outs = llm.embed(prompts, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert_vectors_close(
                out.outputs.embedding, pooled_reference(base, tok.encode(prompt), pooling_type)
            )
        assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory):
    """A sentence-transformers folder around a Qwen3Model checkpoint (tensors without "model.", no
    head): MEAN pooling, a Normalize module. (path, the torch base model)"""
    import transformers

    path = tmp_path_factory.mktemp("st_qwen3")
    torch.manual_seed(1)
    config = transformers.Qwen3Config(**{**TINY_LLAMA, "head_dim": 24})
    base = transformers.Qwen3Model(config).eval()
    base.save_pretrained(path)
    tokenizer = make_tokenizer(config.vocab_size)
    tokenizer.pad_token = tokenizer.eos_token  # sentence-transformers pads its batches (masked)
    tokenizer.save_pretrained(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": 64,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(path), base


def test_base_model_with_sentence_transformers_files(st_folder):
    """Served for pooling with no flag, pooled as the folder says."""
    path, base = st_folder
    llm = LLM(path, **engine_kwargs())
    assert llm.llm_engine.config.model_config.runner_type == "pooling"
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, llm.embed(PROMPTS, use_tqdm=False)):
        assert_vectors_close(out.outputs.embedding, pooled_reference(base, tok.encode(prompt), "MEAN"))


def test_retrieval_ranks_as_sentence_transformers(st_folder):
    """20 queries against 52 documents: the served embeddings' top 5 of each query, and LLM.score's
    similarities, are sentence-transformers' own on the same folder."""
    from sentence_transformers import SentenceTransformer

    path, _ = st_folder
    corpus = json.loads(
        (pathlib.Path(__file__).parents[1] / "fixtures" / "retrieval_corpus.json").read_text()
    )
    docs, queries = corpus["documents"], corpus["queries"]
    st = SentenceTransformer(path, device="cpu")
    st_docs, st_queries = st.encode(docs), st.encode(queries)
    llm = LLM(path, **engine_kwargs(max_model_len=64))
    ours_docs = np.array([o.outputs.embedding for o in llm.embed(docs, use_tqdm=False)])
    ours_queries = np.array([o.outputs.embedding for o in llm.embed(queries, use_tqdm=False)])
    np.testing.assert_allclose(ours_docs, st_docs, atol=2e-5)
    want = np.argsort(-(st_queries @ st_docs.T), axis=1)[:, :5]
    got = np.argsort(-(ours_queries @ ours_docs.T), axis=1)[:, :5]
    np.testing.assert_array_equal(got, want)
    scores = [o.outputs.score for o in llm.score(queries[0], docs[:8], use_tqdm=False)]
    np.testing.assert_allclose(scores, st.similarity(st_queries[:1], st_docs[:8]).numpy()[0], atol=1e-5)


def test_matryoshka_dimensions_and_truncation(qwen3):
    path, base = qwen3
    kw = engine_kwargs(hf_overrides={"matryoshka_dimensions": [16, 32, 64]}, max_model_len=40)
    llm = LLM(path, runner="pooling", **kw)
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[1])
    assert len(ids) > 40
    (cut,) = llm.embed(PROMPTS[0], PoolingParams(dimensions=16), use_tqdm=False)
    assert_vectors_close(
        cut.outputs.embedding, pooled_reference(base, tok.encode(PROMPTS[0]), "LAST", dims=16)
    )
    (last,) = llm.embed(PROMPTS[1], truncate_prompt_tokens=20, use_tqdm=False)
    assert last.prompt_token_ids == ids[-20:]
    assert_vectors_close(last.outputs.embedding, pooled_reference(base, ids[-20:], "LAST"))
    (whole,) = llm.embed(PROMPTS[1], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    assert whole.prompt_token_ids == ids[-40:]
    with pytest.raises(ValueError, match="only supports \\[16, 32, 64\\] matryoshka dimensions"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=20), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 40 tokens.*embedding generation"):
        llm.embed(PROMPTS[1], use_tqdm=False)
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.embed(PROMPTS[0], truncate_prompt_tokens=41, use_tqdm=False)
    with pytest.raises(ValueError, match="generates no text"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    # the refused requests left nothing behind: the engine still embeds
    (again,) = llm.embed(PROMPTS[0], use_tqdm=False)
    assert_vectors_close(again.outputs.embedding, pooled_reference(base, tok.encode(PROMPTS[0]), "LAST"))


def test_generative_model_refuses_pooling(qwen3):
    path, _ = qwen3
    llm = LLM(path, **engine_kwargs())
    with pytest.raises(ValueError, match="needs a pooling model"):
        llm.embed(PROMPTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="embeddings need a pooling model"):
        llm.llm_engine.add_request("x", PROMPTS[0], PoolingParams())
    (out,) = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_dimensions_need_a_matryoshka_model(qwen3):
    path, _ = qwen3
    llm = LLM(path, task="embed", **engine_kwargs())
    with pytest.raises(ValueError, match="does not support matryoshka representation"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=16), use_tqdm=False)


@pytest.mark.parametrize("chunked", [False, True])
def test_classifier_probabilities_match_transformers(tmp_path, chunked):
    """A Qwen3ForSequenceClassification of three labels: served for classification with no flag,
    its probabilities are the softmax of transformers' logits (also with the prompt in chunks:
    the score head is linear, so it applies to the step's rows as to the last hidden state)."""
    model = make_classifier(tmp_path, "Qwen3ForSequenceClassification", ["neg", "neutral", "pos"])
    kw = engine_kwargs(max_num_batched_tokens=16) if chunked else engine_kwargs()
    llm = LLM(str(tmp_path), **kw)
    assert llm.llm_engine.config.model_config.pooler_config.labels == ("neg", "neutral", "pos")
    tok = llm.get_tokenizer()
    outs = llm.classify(PROMPTS, use_tqdm=False)
    logits = llm.encode(PROMPTS, PoolingParams(use_activation=False), use_tqdm=False)
    for prompt, out, raw in zip(PROMPTS, outs, logits):
        want = classifier_logits(model, tok.encode(prompt))
        assert out.outputs.num_classes == 3
        np.testing.assert_allclose(raw.outputs.data, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out.outputs.probs, np.exp(want) / np.exp(want).sum(), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="served for classification; embeddings need an embedding model"):
        llm.embed(PROMPTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions and normalize apply to embeddings"):
        llm.classify(PROMPTS[0], PoolingParams(dimensions=4), use_tqdm=False)
    with pytest.raises(ValueError, match="needs a cross-encoder \\(one label\\); this one has 3"):
        llm.score(PROMPTS[0], PROMPTS[1])


def test_cross_encoder_scores_pairs_read_together(tmp_path, qwen3):
    """A LlamaForSequenceClassification of one label scores a pair as the sigmoid of its logit over
    the two texts joined as the tokenizer joins a pair; an embedding model refuses to classify."""
    model = make_classifier(tmp_path, "LlamaForSequenceClassification", ["relevant"])
    llm = LLM(str(tmp_path), task="score", **engine_kwargs())
    tok = llm.get_tokenizer()
    outs = llm.score(PROMPTS[0], PROMPTS, use_tqdm=False)
    for doc, out in zip(PROMPTS, outs):
        ids = tok(PROMPTS[0], doc)["input_ids"]
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(
            1 / (1 + np.exp(-classifier_logits(model, ids)[0])), abs=1e-6
        )
    embedder = LLM(qwen3[0], runner="pooling", **engine_kwargs())
    with pytest.raises(ValueError, match="served for embeddings; classification needs"):
        embedder.classify(PROMPTS[0], use_tqdm=False)


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_encoders_match_transformers(tmp_path, model_type):
    """BERT and XLM-RoBERTa encoders: every token sees its whole sequence, learned positions (offset
    in RoBERTa), token types from the separator; CLS (their default) and MEAN pooling agree with
    transformers, for single texts and for pairs read together ([CLS] a [SEP] b [SEP], types 0 / 1)."""
    model = make_encoder_checkpoint(tmp_path, model_type)
    llm = LLM(str(tmp_path), **engine_kwargs(max_num_batched_tokens=128, max_model_len=96))
    assert llm.llm_engine.config.model_config.pooler_config.pooling_type == "CLS"
    assert not llm.llm_engine.config.scheduler_config.enable_chunked_prefill
    tok = llm.get_tokenizer()
    encodings = [tok(p) for p in PROMPTS] + [tok(PROMPTS[0], PROMPTS[2]), tok(PROMPTS[3], PROMPTS[1])]
    prompts = [{"prompt_token_ids": e["input_ids"]} for e in encodings]
    mean = LLM(str(tmp_path), **engine_kwargs(max_num_batched_tokens=128, max_model_len=96,
                                              pooler_config={"pooling_type": "MEAN"}))  # fmt: skip
    for out, mean_out, enc in zip(
        llm.embed(prompts, use_tqdm=False), mean.embed(prompts, use_tqdm=False), encodings
    ):
        types = enc.get("token_type_ids") if model_type == "bert" else None
        with torch.no_grad():
            hidden = (
                model(
                    torch.tensor([enc["input_ids"]]),
                    token_type_ids=None if types is None else torch.tensor([types]),
                )
                .last_hidden_state[0]
                .double()
                .numpy()
            )
        for got, want in ((out, hidden[0]), (mean_out, hidden.mean(0))):
            assert_vectors_close(got.outputs.embedding, want / np.linalg.norm(want))
    assert any(1 in e["token_type_ids"] for e in encodings)  # the pairs had second segments


@pytest.mark.parametrize("model_type, num_labels", [("bert", 1), ("xlm-roberta", 3)])
def test_encoder_classifiers_match_transformers(tmp_path, model_type, num_labels):
    """BERT / XLM-RoBERTa *ForSequenceClassification: the head (tanh(dense([CLS])), then a projection)
    over [CLS]; one label is a cross-encoder: LLM.score reads a pair with its token types and
    answers the sigmoid of the logit, as transformers' model gives it."""
    model = make_encoder_checkpoint(tmp_path, model_type, num_labels=num_labels)
    llm = LLM(str(tmp_path), **engine_kwargs(max_num_batched_tokens=128, max_model_len=96))
    tok = llm.get_tokenizer()

    def logits(enc):
        types = enc.get("token_type_ids") if model_type == "bert" else None
        with torch.no_grad():
            out = model(
                torch.tensor([enc["input_ids"]]),
                token_type_ids=None if types is None else torch.tensor([types]),
            )
        return out.logits[0].double().numpy()

    if num_labels == 1:
        scores = llm.score(PROMPTS[0], PROMPTS, use_tqdm=False)
        want = [1 / (1 + np.exp(-logits(tok(PROMPTS[0], doc))[0])) for doc in PROMPTS]
        np.testing.assert_allclose([s.outputs.score for s in scores], want, atol=1e-6)
    else:
        for prompt, out in zip(PROMPTS, llm.classify(PROMPTS, use_tqdm=False)):
            want = logits(tok(prompt))
            np.testing.assert_allclose(out.outputs.probs, np.exp(want) / np.exp(want).sum(), atol=1e-6)
    with pytest.raises(ValueError, match="pooling_type must be CLS"):
        LLM(str(tmp_path), **engine_kwargs(max_num_batched_tokens=128, max_model_len=96,
                                           pooler_config={"pooling_type": "MEAN"}))  # fmt: skip


def test_an_encoder_is_served_for_pooling_only(tmp_path):
    make_encoder_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="BertModel is an encoder: it is served for pooling only"):
        LLM(str(tmp_path), runner="generate", **engine_kwargs())
    with pytest.raises(ValueError, match="An encoder runs a prompt whole in one step"):
        LLM(str(tmp_path), **engine_kwargs(max_num_batched_tokens=64, max_model_len=96))


def test_modernbert_matches_transformers(tmp_path):
    """ModernBERT: rotary positions with a global and a local base, local layers seeing 4 tokens
    either side, a gated GELU MLP, no attention norm before the first layer; CLS and MEAN pooling
    agree with transformers on prompts longer than the window."""
    model = make_modernbert(tmp_path)
    tokenizer = make_wordpiece_tokenizer()
    kw = engine_kwargs(max_num_batched_tokens=128, max_model_len=96)
    llm, mean = (
        LLM(str(tmp_path), **kw),
        LLM(str(tmp_path), **{**kw, "pooler_config": {"pooling_type": "MEAN"}}),
    )
    prompts = [{"prompt_token_ids": tokenizer(p)["input_ids"]} for p in PROMPTS]
    for prompt, cls_out, mean_out in zip(
        prompts, llm.embed(prompts, use_tqdm=False), mean.embed(prompts, use_tqdm=False)
    ):
        with torch.no_grad():
            hidden = model(torch.tensor([prompt["prompt_token_ids"]])).last_hidden_state[0].double().numpy()
        for got, want in ((cls_out, hidden[0]), (mean_out, hidden.mean(0))):
            assert_vectors_close(got.outputs.embedding, want / np.linalg.norm(want))


@pytest.mark.parametrize("tokens", [2, 3])
def test_a_generative_model_as_a_classifier_of_its_tokens(qwen3, tokens):
    """vLLM's Qwen3-Reranker recipe: --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"]}' scores a pair with the softmax of the two tokens' logits
    (the sigmoid of their difference); with other counts, the tokens' logits are the classes."""
    path, _ = qwen3
    from transformers import AutoModelForCausalLM

    causal = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chosen = ["Ġthe", "Ġof", "Ġcapital"][:tokens]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": chosen}
    llm = LLM(path, hf_overrides=overrides, **engine_kwargs())
    tok = llm.get_tokenizer()
    ids = tok.convert_tokens_to_ids(chosen)
    for doc in PROMPTS:
        pair = tok(PROMPTS[0], doc)["input_ids"]
        with torch.no_grad():
            logits = causal(torch.tensor([pair])).logits[0, -1, ids].double().numpy()
        if tokens == 2:
            (out,) = llm.score(PROMPTS[0], doc, use_tqdm=False)
            assert out.outputs.score == pytest.approx(np.exp(logits[1]) / np.exp(logits).sum(), abs=1e-6)
        else:
            (out,) = llm.classify({"prompt_token_ids": pair}, use_tqdm=False)
            np.testing.assert_allclose(out.outputs.probs, np.exp(logits) / np.exp(logits).sum(), atol=1e-6)
    bad = {**overrides, "classifier_from_token": ["Ġthe", "no-such-token"]}
    with pytest.raises(ValueError, match="are not all tokens of the model's vocabulary"):
        LLM(path, hf_overrides=bad, **engine_kwargs())


def test_embeddings_with_a_lora_adapter(tmp_path):
    """An embedding model with a LoRA adapter per request: the adapter's vectors are peft's, the
    base model's stay the base model's, in one batch."""
    from jaxserve.lora.request import LoRARequest

    model = make_family_checkpoint(tmp_path / "base", "qwen3")
    peft_model = make_lora_adapter(
        model, tmp_path / "adapter", 4, 8, ("q_proj", "v_proj", "down_proj"), seed=7
    )
    llm = LLM(str(tmp_path / "base"), runner="pooling", enable_lora=True, max_lora_rank=8, **engine_kwargs())
    tok = llm.get_tokenizer()
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    outs = llm.embed(PROMPTS * 2, use_tqdm=False, lora_request=[lora] * len(PROMPTS) + [None] * len(PROMPTS))
    adapted = peft_model.base_model.model.model  # (make_lora_adapter adapted a copy of `model`)
    for i, (prompt, out) in enumerate(zip(PROMPTS * 2, outs)):
        want = pooled_reference(adapted if i < len(PROMPTS) else model.model, tok.encode(prompt), "LAST")
        assert_vectors_close(out.outputs.embedding, want)
    for with_adapter, without in zip(outs[: len(PROMPTS)], outs[len(PROMPTS) :]):
        assert np.abs(np.subtract(with_adapter.outputs.embedding, without.outputs.embedding)).max() > 1e-3


def test_every_step_is_full_while_the_last_is_in_flight(qwen3):
    """Asynchronous scheduling plans a step while the last one runs: its pooling requests end with
    it, so they leave their rows, and in a pool sized for two steps their pages, to the next
    prompts. Twelve prompts of 20 tokens at 64 tokens and 4 rows a step: every step full but the
    last (the same as synchronous scheduling gives), not a full step then the rest of its last
    prompt alone."""
    path, base = qwen3
    kw = engine_kwargs(max_num_seqs=4, max_model_len=24, num_gpu_blocks_override=None)
    llm = LLM(path, runner="pooling", **kw)
    runner = llm.llm_engine.runner
    steps, dispatch = [], runner.dispatch
    runner.dispatch = lambda sched, *a, **k: steps.append(sched.num_tokens) or dispatch(sched, *a, **k)
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 500 for j in range(20)]} for i in range(12)]
    outs = llm.embed(prompts, use_tqdm=False)
    assert steps == [64, 64, 64, 48]
    ids = prompts[-1]["prompt_token_ids"]
    assert_vectors_close(outs[-1].outputs.embedding, pooled_reference(base, ids, "LAST"))
