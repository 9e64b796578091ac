"""GGUF loading: config, tensors (names, layout, dequantization, q/k un-permute) and tokenizer.

Tiny files written here check the translation exactly; the real default model is checked against
transformers' own GGUF loader, the reference the model ports are measured with.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from tiny_checkpoints import CHAT_TEMPLATE, llama_cpp_permute, write_tiny_gguf

from jaxserve.loader.gguf import iter_gguf_tensors, load_gguf_tokenizer, read_gguf_config
from jaxserve.loader.gguf_blocks import unpermute_rows

TEXTS = [
    "Hello world!",
    " leading space and  double  spaces",
    "héllo ünïcode 日本語 🤗",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n\treturn x ** 2  # ok\n",
    "",
]


# ---------------------------------------------------------------- tiny files


def test_tiny_config_matches_what_was_written(tiny_gguf):
    config = read_gguf_config(tiny_gguf.path)
    for key, value in tiny_gguf.config.items():
        assert config[key] == value, key
    assert "rope_scaling" not in config


def test_tiny_tensors_round_trip_to_hf_names_and_layout(tiny_gguf):
    got = dict(iter_gguf_tensors(tiny_gguf.path, use_tqdm=False))
    assert set(got) == set(tiny_gguf.tensors)
    assert ("lm_head.weight" in got) != tiny_gguf.config["tie_word_embeddings"]
    for name, expected in tiny_gguf.tensors.items():
        assert got[name].dtype == np.float32, name
        assert got[name].shape == expected.shape, name
        assert got[name].flags.writeable and got[name].flags.c_contiguous, name
        np.testing.assert_array_equal(got[name], expected, err_msg=name)


@pytest.mark.parametrize(
    "qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"]
)
def test_quantized_weights_dequantize_in_hf_layout(qtype, tmp_path):
    import gguf

    written = write_tiny_gguf(
        str(tmp_path / f"{qtype}.gguf"), tied=True, ffn_down_type=getattr(gguf.GGMLQuantizationType, qtype)
    )
    got = dict(iter_gguf_tensors(written.path, use_tqdm=False))
    for layer in range(2):
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        assert got[name].shape == (64, 256) and got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], written.tensors[name], err_msg=name)


def test_q8_0_embedding_is_close_to_the_unquantized_values(tiny_gguf):
    embed = dict(iter_gguf_tensors(tiny_gguf.path, use_tqdm=False))["model.embed_tokens.weight"]
    rng = np.random.default_rng(0)  # the writer's first draw is the embedding
    original = rng.standard_normal(embed.shape, dtype=np.float32)
    np.testing.assert_allclose(embed, original, atol=0.05)


@pytest.mark.parametrize("num_heads, rows, cols", [(4, 64, 32), (2, 32, 64), (9, 576, 8), (3, 192, 1)])
def test_unpermute_inverts_llama_cpp_permute(num_heads, rows, cols):
    weights = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    permuted = llama_cpp_permute(weights, num_heads)
    assert not np.array_equal(permuted, weights)
    np.testing.assert_array_equal(unpermute_rows(permuted, num_heads, "t", "f"), weights)
    bias = weights[:, 0].copy()
    np.testing.assert_array_equal(
        unpermute_rows(llama_cpp_permute(bias, num_heads), num_heads, "t", "f"), bias
    )


@pytest.mark.parametrize("tokenizer_model", ["gpt2", "llama"])
def test_tiny_tokenizer_matches_transformers(tmp_path, tokenizer_model):
    from transformers import AutoTokenizer

    path = write_tiny_gguf(str(tmp_path / "tok.gguf"), tied=True, tokenizer=tokenizer_model).path
    ours = load_gguf_tokenizer(path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    assert ours.is_fast
    assert ours.chat_template == CHAT_TEMPLATE
    for text in [*TEXTS, "hello world", "hello</s>"]:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text)), text
    assert (ours.bos_token, ours.eos_token) == (reference.bos_token, reference.eos_token)


def test_tokenizer_comes_from_the_gguf_even_beside_another_tokenizer_json(tmp_path):
    other = write_tiny_gguf(str(tmp_path / "other.gguf"), tied=True, tokenizer="gpt2").path
    load_gguf_tokenizer(other).save_pretrained(str(tmp_path / "model"))  # tokenizer.json of another model
    path = write_tiny_gguf(str(tmp_path / "model" / "spm.gguf"), tied=True, tokenizer="llama").path
    alone = write_tiny_gguf(str(tmp_path / "spm.gguf"), tied=True, tokenizer="llama").path
    tokenizer, reference = load_gguf_tokenizer(path), load_gguf_tokenizer(alone)
    assert tokenizer.bos_token == "<s>"
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text), text
    assert tokenizer.name_or_path == str(tmp_path / "model")


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "q.gguf"), tied=True, architecture="gemma").path
    for load in (read_gguf_config, iter_gguf_tensors):
        with pytest.raises(ValueError, match=r"'gemma'.*supported: llama, qwen2"):
            load(path)


def test_linear_rope_scaling_reaches_the_config(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "r.gguf"), tied=True, linear_rope_factor=4.0).path
    assert read_gguf_config(path)["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_rope_freqs_is_skipped_with_a_warning(tmp_path, caplog):
    rope_freqs = np.ones(8, dtype=np.float32)
    tiny = write_tiny_gguf(
        str(tmp_path / "f.gguf"), tied=True, extra_tensors={"rope_freqs.weight": rope_freqs}
    )
    with caplog.at_level("WARNING", logger="jaxserve.loader.gguf"):
        got = dict(iter_gguf_tensors(tiny.path, use_tqdm=False))
    assert set(got) == set(tiny.tensors)
    assert "rope_freqs.weight" in caplog.text


def test_unknown_tensor_is_refused_by_name(tmp_path):
    extra = {"blk.0.attn_q_norm.weight": np.ones(16, dtype=np.float32)}
    path = write_tiny_gguf(str(tmp_path / "u.gguf"), tied=True, extra_tensors=extra).path
    with pytest.raises(ValueError, match=r"u\.gguf: tensor 'blk\.0\.attn_q_norm\.weight'"):
        iter_gguf_tensors(path, use_tqdm=False)


# ---------------------------------------------------------------- bad files


@pytest.fixture
def bad_files(tmp_path, tiny_gguf) -> dict[str, str]:
    data = open(tiny_gguf.path, "rb").read()
    files = {
        "text": b'{"not": "a gguf"}\n' * 10,
        "empty": b"",
        "truncated_header": data[:100],
        "truncated_tensors": data[: len(data) // 2],
        "truncated_tail": data[:-8],
    }
    paths = {}
    for name, content in files.items():
        paths[name] = str(tmp_path / f"{name}.gguf")
        with open(paths[name], "wb") as f:
            f.write(content)
    paths["missing"] = str(tmp_path / "missing.gguf")
    return paths


@pytest.mark.parametrize("load", [read_gguf_config, iter_gguf_tensors, load_gguf_tokenizer])
def test_bad_files_raise_value_error_naming_the_file(bad_files, load):
    for path in bad_files.values():
        with pytest.raises(ValueError, match=os.path.basename(path)):
            load(path)


# ---------------------------------------------------------------- the real default model


@pytest.mark.slow
def test_default_model_tensors_equal_transformers(default_gguf, smollm2_reference):
    reference = {name: t.numpy() for name, t in smollm2_reference.state_dict().items()}
    seen = set()
    for name, weights in iter_gguf_tensors(default_gguf, use_tqdm=False):
        assert name in reference, name
        assert weights.shape == reference[name].shape, name
        if not np.array_equal(weights, reference[name]):  # same dequantizer: usually bit-equal, and fast
            np.testing.assert_allclose(weights, reference[name], rtol=0, atol=1e-6, err_msg=name)
        seen.add(name)
    # tied: transformers shares lm_head with the embedding; this file has no output.weight
    assert set(reference) - seen == {"lm_head.weight"}
    np.testing.assert_array_equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])


@pytest.mark.slow
def test_default_model_config_agrees_with_transformers(default_gguf, smollm2_reference):
    config = read_gguf_config(default_gguf)
    reference = smollm2_reference.config
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
        "attention_bias", "mlp_bias", "model_type",
    ):  # fmt: skip
        assert config[key] == getattr(reference, key), key
    rope_theta = getattr(reference, "rope_theta", None) or reference.rope_parameters["rope_theta"]
    assert config["rope_theta"] == rope_theta
    assert config["architectures"] == ["LlamaForCausalLM"]
    # what the machine notes promise for SmolLM2
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (30, 576, 64)


@pytest.mark.slow
def test_default_model_tokenizer_matches_transformers(default_gguf):
    from transformers import AutoTokenizer

    ours = load_gguf_tokenizer(default_gguf)
    model_dir, file_name = os.path.split(default_gguf)
    reference = AutoTokenizer.from_pretrained(model_dir, gguf_file=file_name)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text)), text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ours_chat = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours_chat == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours_chat.startswith("<|im_start|>system\n") and ours_chat.endswith("<|im_start|>assistant\n")
    assert ours.encode(ours_chat) == reference.encode(ours_chat)
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_gguf_and_safetensors_of_the_same_weights_give_identical_logits(architecture, tmp_path):
    from reference_checks import prompt_logits, teacher_forced_logits
    from tiny_checkpoints import write_gguf_from_hf
    from tiny_models import engine_kwargs, make_family_checkpoint, make_llama_checkpoint

    from jaxserve.args import EngineArgs
    from jaxserve.runner.model_runner import ModelRunner

    hf_dir = tmp_path / "hf"
    if architecture == "llama":
        torch_model = make_llama_checkpoint(hf_dir, "gqa")
    else:
        torch_model = make_family_checkpoint(hf_dir, "qwen2")
    gguf_path = str(tmp_path / "model.gguf")
    write_gguf_from_hf(gguf_path, torch_model, architecture)
    ids = np.random.default_rng(0).integers(3, 500, size=30).tolist()
    logits = []
    for model in (str(hf_dir), gguf_path):
        runner = ModelRunner(EngineArgs(model=model, **engine_kwargs()).create_engine_config())
        assert runner.config.model_config.architecture == torch_model.config.architectures[0]
        logits.append(prompt_logits(runner, ids))
    np.testing.assert_array_equal(logits[0], logits[1])
    np.testing.assert_allclose(logits[1], teacher_forced_logits(torch_model, ids), atol=1e-4, rtol=0)


def test_second_load_reads_the_file_cache_not_the_gguf(tmp_path, monkeypatch):
    """The first load keeps the config and the dequantized, stacked weights; the next one reads
    them back without parsing the file, and gets the same parameters. A damaged entry is rebuilt."""
    import jax
    from tiny_models import engine_kwargs

    from jaxserve.args import EngineArgs
    from jaxserve.loader import gguf as gguf_module
    from jaxserve.loader import model_loader
    from jaxserve.sharding import make_mesh

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_tiny_gguf(str(tmp_path / "m.gguf"), tied=False).path

    def load():
        config = EngineArgs(model=path, **engine_kwargs()).create_engine_config().model_config
        return model_loader.load_model(config, make_mesh(1))[1]

    first = load()
    entries = list((tmp_path / "cache" / "jaxserve" / "files").iterdir())
    # (weights "-groups": the file's Q8_0 embedding is kept in its groups)
    assert len(entries) == 1 and {p.name for p in entries[0].iterdir()} == {
        "config",
        "kernel-formats",
        "weights-kv1-groups",
    }

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf_module, "_open_version", refuse)
    monkeypatch.setattr(gguf_module, "iter_gguf_tensors", refuse)
    second = load()
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    weights = entries[0] / "weights-kv1-groups"
    victim = sorted(weights.iterdir())[0]
    victim.write_bytes(b"not an array")
    third = load()
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(third), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.load(victim)  # rebuilt whole
