"""Comparisons against transformers shared by the model and engine tests."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import re

import jax
import numpy as np
from flax import nnx

from jaxserve.runner.model_runner import ModelRunner
from jaxserve.scheduler_output import SamplingRow, ScheduledSeq, SchedulerOutput

# transformers' top-2 logit gap under which float noise may flip a greedy choice.
NEAR_TIE = 1e-3


def teacher_forced_logits(torch_model, token_ids: list[int]) -> np.ndarray:  # [len, vocab]
    import torch

    with torch.no_grad():
        return torch_model(torch.tensor([token_ids])).logits[0].float().numpy()


def check_greedy(torch_model, prompt: list[int], generated: list[int]) -> tuple[int, int]:
    """Assert every generated token is transformers' argmax given the same prefix,
    skipping positions where transformers' own top two are a near tie.
    Returns (compared, total)."""
    logits = teacher_forced_logits(torch_model, prompt + generated)
    compared = 0
    for i, token in enumerate(generated):
        row = logits[len(prompt) + i - 1]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] < NEAR_TIE:
            continue
        assert token == int(np.argmax(row)), (
            f"step {i}: jaxserve chose {token}, transformers {int(np.argmax(row))} (gap {top2[1] - top2[0]:.2e})"
        )
        compared += 1
    return compared, len(generated)


GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, output_start=0)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, kv_pool, inputs):
    model = nnx.merge(graphdef, state)
    lora = {} if inputs.lora_slots is None else {"lora_slots": inputs.lora_slots}
    logits, _ = model(inputs.input_ids, inputs.positions, kv_pool, inputs.meta, inputs.logits_indices, **lora)
    return logits


def prompt_logits(runner: ModelRunner, token_ids: list[int], lora_slot: int = -1) -> np.ndarray:
    """Run the model over one prompt through the runner's own batch layout and paged KV
    pool, asking for logits at every position (with the adapter in `lora_slot`). Prompts are
    padded to a power of two of at least 64 tokens, so one compiled program serves every short
    prompt of a test."""
    n = len(token_ids)
    padded = max(64, 1 << (n - 1).bit_length())
    pages = tuple(range(1, 1 + -(-n // runner.page_size)))
    seq = ScheduledSeq("r", tuple(token_ids), 0, pages, GREEDY, lora_slot=lora_slot)
    sched = SchedulerOutput((seq,))
    inputs = runner.prepare(sched, (padded, 1))
    indices = np.zeros(padded, np.int32)
    indices[:n] = np.arange(n)
    inputs = dataclasses.replace(inputs, logits_indices=indices)
    logits = _forward(runner.graphdef, runner.state, runner.kv_pool, jax.device_put(inputs))
    return np.asarray(logits)[:n]


def assert_greedy_generation_matches(
    llm, torch_model, prompts: list[list[int]], max_tokens: int = 32
) -> None:
    """Greedy-generate a batch of prompts together and check every token against
    transformers; most steps must be compared (not skipped as near ties)."""
    from jaxserve import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    compared = total = 0
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        completion = out.outputs[0]
        assert len(completion.token_ids) == max_tokens and completion.finish_reason == "length"
        c, t = check_greedy(torch_model, prompt, completion.token_ids)
        compared, total = compared + c, total + t
    assert compared >= 0.9 * total, f"only {compared} of {total} steps compared"


def assert_logits_match_at_every_position(
    path: str, torch_model, atol: float = 1e-4, lengths=(1, 7, 8, 9, 45), **engine_overrides
) -> None:
    """Logits at every position of prompts of several lengths (around page boundaries and
    past several pages) against transformers."""
    from tiny_models import engine_kwargs

    from jaxserve.args import EngineArgs

    runner = ModelRunner(EngineArgs(model=path, **engine_kwargs(**engine_overrides)).create_engine_config())
    rng = np.random.default_rng(0)
    for n in lengths:
        ids = rng.integers(3, 500, size=n).tolist()
        np.testing.assert_allclose(
            prompt_logits(runner, ids), teacher_forced_logits(torch_model, ids), atol=atol, rtol=0
        )


def assert_greedy_batch_matches(
    path: str, torch_model, prompt_lens=(3, 17, 40, 9, 64, 1), **engine_overrides
) -> None:
    """32 greedy steps over a batch of mixed-length prompts, run together."""
    from tiny_models import engine_kwargs

    from jaxserve import LLM

    llm = LLM(path, **engine_kwargs(**engine_overrides))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in prompt_lens]
    assert_greedy_generation_matches(llm, torch_model, prompts)


def hf_beams(model, prompt, width, max_tokens, length_penalty, eos):
    """transformers' beam search (early_stopping=False): the generated tokens of each of the
    `width` returned sequences, best first, and their scores."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=False,
            eos_token_id=eos,
            pad_token_id=eos if eos is not None else 0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    seqs = []
    for row in out.sequences[:, len(prompt) :].tolist():
        if eos is not None and eos in row:  # finished early: the rest is padding
            row = row[: row.index(eos) + 1]
        seqs.append(row)
    return seqs, out.sequences_scores.tolist()


@contextlib.contextmanager
def compilations():
    """Collects an entry for every XLA compilation that happens inside the block."""
    events: list[str] = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# The decoder projections each family quantizes, by transformers' parameter names; GPT-2's
# Conv1D weights are [in, out], every other one [..., out, in].
PROJECTIONS = re.compile(
    r"layers\.\d+\.(self_attn\.(q|k|v|o|qkv|out)_proj|mlp\.(gate|up|down|gate_up)_proj|fc1|fc2"
    r"|mlp\.experts\.(gate_up|down)_proj)(\.weight)?$|^transformer\.h\.\d+\.(attn|mlp)\.c_\w+\.weight$"
)
QMAX = {"int8": 127.0, "fp8": 448.0}


def quantized_reference(model, quantization: str):
    """A copy of the torch model whose decoder projections went through the quantizer."""
    import torch

    ref = copy.deepcopy(model)
    names = []
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if not PROJECTIONS.search(name):
                continue
            names.append(name)
            in_axis = 0 if name.startswith("transformer.h.") else -1
            scale = param.abs().amax(dim=in_axis, keepdim=True).clamp_min(1e-30) / QMAX[quantization]
            v = param / scale
            v = v.round().clamp(-127, 127) if quantization == "int8" else v.to(torch.float8_e4m3fn).float()
            param.copy_(v * scale)
    assert names, "no projection matched"
    return ref


def fake_quantize_kv(x, scale: float, dtype: str):
    """x as a quantized KV page stores it and attention reads it back (torch): x / scale rounded
    to int8 (saturating at +-127) or cast to fp8 (saturating at its largest value), times scale."""
    import torch

    x = x.float() / scale
    if dtype == "int8":
        x = x.round().clamp(-127, 127)
    else:
        fp8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[dtype]
        largest = torch.finfo(fp8).max
        x = x.clamp(-largest, largest).to(fp8).float()
    return x * scale


def kv_quantized_reference(model, scales: np.ndarray, dtype: str):
    """A copy of the torch model whose attention reads each layer's keys (after rope) and values
    as quantized pages of `dtype` with that layer's scales ([num_layers, 2]) give them back."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = (float(s) for s in scales[module.layer_idx])
        key, value = fake_quantize_kv(key, k_scale, dtype), fake_quantize_kv(value, v_scale, dtype)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    name = f"jaxserve-kv-{dtype}-{len(AttentionInterface._global_mapping)}"
    AttentionInterface.register(name, attention)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation(name)
    return ref


def kv_amax(model, token_ids: list[int]) -> np.ndarray:
    """[num_layers, 2]: the largest |key| (after rope) and |value| each layer computes over
    `token_ids` in the torch model."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    amax = np.zeros((model.config.num_hidden_layers, 2))

    def attention(module, query, key, value, *args, **kwargs):
        amax[module.layer_idx] = [float(key.abs().max()), float(value.abs().max())]
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("jaxserve-kv-amax", attention)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("jaxserve-kv-amax")
    with torch.no_grad():
        ref(torch.tensor([token_ids]))
    return amax


def pooled_reference(base_model, ids: list[int], pooling_type: str, normalize: bool = True, dims=None):
    """transformers' last_hidden_state of `ids` pooled LAST, MEAN or CLS, cut to `dims` and
    normalized as a pooling model's embedding is (float64)."""
    import torch

    with torch.no_grad():
        hidden = base_model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type][:dims]
    return vector / np.linalg.norm(vector) if normalize else vector


def assert_vectors_close(got, want) -> None:
    """Float32 pooled vectors against a reference: cosine above 0.99999 and elementwise close."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    cosine = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
    assert cosine > 0.99999, cosine
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def classifier_logits(model, ids: list[int]) -> np.ndarray:
    """transformers' sequence-classifier logits of one prompt (its last token's score), float64."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def qwen_vl_reference(model, image_processor, tokenizer, prompt: str, images: list, max_tokens: int):
    """transformers' (Qwen2-VL / Qwen2.5-VL) prompt tokens, greedy tokens and first-step logprobs
    for a prompt whose `<|image_pad|>` placeholders stand for `images` (expanded to each image's
    count, as its processor does)."""
    import torch

    pad = "<|image_pad|>"
    inputs = {}
    if images:
        pixels = image_processor(images=images, return_tensors="pt")
        merge = image_processor.merge_size**2
        counts = iter((pixels["image_grid_thw"].prod(-1) // merge).tolist())
        prompt = "".join(
            p + (pad * next(counts) if i < len(images) else "") for i, p in enumerate(prompt.split(pad))
        )
        inputs = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}
    ids = torch.tensor([tokenizer.encode(prompt)])
    inputs |= {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs["mm_token_type_ids"] = (ids == tokenizer.convert_tokens_to_ids(pad)).int()
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    first = torch.log_softmax(out.logits[0][0].double(), -1).numpy()
    return ids[0].tolist(), out.sequences[0, ids.shape[1] :].tolist(), first


def load_vision_tower(path, args_cls, tower_cls, weight_map, split_tensor):
    """A vision tower from a saved checkpoint's `visual.*` tensors, as the loader reads them:
    split, mapped, transposed and stacked per layer; every mapped tensor present and every
    vision tensor mapped. (args, tower)."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    v = args_cls.from_hf(json.loads((path / "config.json").read_text()))
    table = weight_map(v)
    tower = nnx.eval_shape(lambda: tower_cls(v, jnp.float32, nnx.Rngs(0)))  # every value is read
    buffers: dict[str, np.ndarray] = {}
    filled = set()
    for file in sorted(path.glob("*.safetensors")):
        for raw_name, raw in load_file(str(file)).items():
            for name, tensor in split_tensor(raw_name, raw) if raw_name.startswith("visual.") else ():
                ours, index, transpose = table[name]
                attr = ours.removeprefix("vision.")
                tensor = tensor.T if transpose else tensor
                if index is None:
                    buffers[attr] = tensor
                else:
                    buffers.setdefault(attr, np.zeros(getattr(tower, attr).value.shape, np.float32))[
                        index
                    ] = tensor
                filled.add(name)
    assert filled == set(table)
    assert set(buffers) == {k for k, val in vars(tower).items() if isinstance(val, nnx.Param)}
    for attr, value in buffers.items():
        assert value.shape == getattr(tower, attr).value.shape, attr
        getattr(tower, attr).value = jnp.asarray(value)
    return v, tower
