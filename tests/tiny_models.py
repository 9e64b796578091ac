"""Tiny random Hugging Face checkpoints made on the spot with transformers + torch (the
reference), and engine arguments sized for a 2-core CPU."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

# XLA flags for every process the tests start: the suite compiles thousands of small programs
# whose run time is negligible, and LLVM's optimizations cost a quarter of its time (a full run
# here: ~30% less for engine tests, ~15% for the default model's). Numerics are unchanged in
# kind: each test compares against transformers or an engine compiled the same way.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"

TINY_LLAMA = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

# 8 query heads (tp = 8 gives each device one), 2 KV heads (tp = 4 and 8 store copies).
TP_LLAMA = {**TINY_LLAMA, "num_attention_heads": 8, "num_key_value_heads": 2}

LLAMA_VARIANTS = {
    "gqa": {},
    "tied": {"tie_word_embeddings": True, "num_key_value_heads": 4},
    "llama3_rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        "rope_theta": 500000.0,
        "num_key_value_heads": 1,
    },
    "yarn_rope": {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        "rope_theta": 10000.0,
    },
}

# LongRoPE over a rotary of 8 dims (4 frequencies); trained length 256 = served length.
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.3, 2.1, 3.4],
    "long_factor": [1.2, 2.5, 4.0, 9.0],
    "original_max_position_embeddings": 256,
    "partial_rotary_factor": 0.5,
}

# Other dense families: (transformers config class, model class, config overrides).
DENSE_FAMILIES = {
    # a window shorter than the longer test prompts, so the window really cuts
    "mistral_swa": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    # fused qkv / gate_up projections in the checkpoint; a window shorter than long prompts
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 24, "pad_token_id": 0}),
    # half the head rotated, LongRoPE's short factors (served within the trained length)
    "phi3_longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "partial_rotary_factor": 0.5,
            "rope_parameters": PHI3_LONGROPE,
            "original_max_position_embeddings": 256,
            "pad_token_id": 0,
        },
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    # windows on the layers from max_window_layers up only
    "qwen2_swa": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    # caps small enough to bend real scores, a softmax scale off 1/sqrt(head_dim), and a
    # windowed layer next to a full one
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 10.0,
            "sliding_window": 16,
        },
    ),
    # windowed and full layers with rope bases (and scaling) of their own
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        },
    ),
    # head_dim 24 != hidden_size / num_attention_heads, as in the real Qwen3 models
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24, "attention_bias": False}),
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "JAX compiles numerical programs with XLA for TPUs, GPUs and CPUs.",
    "Once upon a time there was a tiny language model that served requests.",
    "café naïve 日本語 emoji 🙂 numbers 0123456789",
]


def make_tokenizer(vocab_size: int):
    """A small byte-level BPE tokenizer trained on the spot (no hub access)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    return fast


# SmolVLM's chat template: an image part is its <image> placeholder, in the text where it stands.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# A tiny Idefics3 / SmolVLM: a 2-layer SigLIP over 32x32 tiles of 8x8 patches (16 patches, 4
# tokens a tile after the pixel shuffle), images resized to at most 96 on the long side (up to
# 3x3 tiles and the global one).
TINY_IDEFICS3_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
TINY_IDEFICS3_PREPROCESSOR = {
    "image_processor_type": "Idefics3ImageProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "size": {"longest_edge": 96},
    "resample": 1,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_pad": True,
    "do_image_splitting": True,
    "max_image_size": {"longest_edge": 32},
}
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]


def make_idefics3_checkpoint(
    path,
    seed: int = 0,
    dtype: str = "float32",
    text: dict | None = None,
    vision: dict | None = None,
    preprocessor: dict | None = None,
    scale_factor: int = 2,
):
    """Save a random Idefics3ForConditionalGeneration (tiny unless `text`, `vision` and
    `preprocessor` override its shapes) with a tokenizer that knows the image tokens, SmolVLM's
    chat template and the image processor's config; return (the torch model, transformers'
    processor for it)."""
    import json

    import torch
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = make_tokenizer(512)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE
    text = {
        **TINY_LLAMA,
        "vocab_size": -(-len(tokenizer) // 8) * 8,
        "max_position_embeddings": 1024,
        **(text or {}),
    }
    vision = {**TINY_IDEFICS3_VISION, **(vision or {})}
    preprocessor = {**TINY_IDEFICS3_PREPROCESSOR, **(preprocessor or {})}
    torch.manual_seed(seed)
    config = transformers.Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(preprocessor, f)
    settings = {k: v for k, v in preprocessor.items() if k != "image_processor_type"}
    seq_len = (vision["image_size"] // vision["patch_size"]) ** 2 // scale_factor**2
    processor = transformers.Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(**settings), tokenizer=tokenizer, image_seq_len=seq_len
    )
    return model, processor


# Qwen2's chat template, images as the vision start, pad and end tokens
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_VL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# A tiny Qwen2-VL: 4x4 patches of 2 frames, 2x2 merged, a 2-layer ViT 32 wide; images resized to
# multiples of 8 between 64 and 4096 pixels (up to 256 patches, 64 image tokens)
TINY_QWEN2_VL_VISION = dict(
    embed_dim=32, depth=2, num_heads=2, mlp_ratio=2, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
    in_channels=3, hidden_size=64,
)  # fmt: skip
TINY_QWEN2_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 64,
    "max_pixels": 4096,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
    "rescale_factor": 1 / 255,
}


# A tiny Qwen2.5-VL encoder: 4x4-pixel patches, 2x2 merged, windows of 16 pixels (2x2 merged units
# each); three blocks, the middle one over the whole image
TINY_QWEN2_5_VL_VISION = dict(
    depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
    spatial_merge_size=2, in_channels=3, window_size=16, out_hidden_size=64, fullatt_block_indexes=[1],
    hidden_act="silu",
)  # fmt: skip


def make_qwen2_vl_checkpoint(path, seed: int = 0, family: str = "Qwen2VL"):
    """Save a tiny random Qwen2VLForConditionalGeneration (or, family "Qwen2_5_VL", Qwen2.5-VL's;
    M-RoPE sections 2, 3, 3 of its 8 frequencies; norms off the identity) with a tokenizer that
    knows the vision tokens, a Qwen2-style chat template and the image processor's config; return
    (the torch model, transformers' image processor)."""
    import json

    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = make_tokenizer(512)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_VL_TOKENS})
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_TOKENS}
    text = {
        **TINY_LLAMA,
        "vocab_size": -(-len(tokenizer) // 8) * 8,
        "max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    }
    torch.manual_seed(seed)
    vision = TINY_QWEN2_VL_VISION if family == "Qwen2VL" else TINY_QWEN2_5_VL_VISION
    config = getattr(transformers, f"{family}Config")(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2 and ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.ndim >= 2:
                p.normal_(0.0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(TINY_QWEN2_VL_PREPROCESSOR, f)
    settings = {k: v for k, v in TINY_QWEN2_VL_PREPROCESSOR.items() if k != "image_processor_type"}
    return model, Qwen2VLImageProcessorPil(**settings)


def make_llama_checkpoint(path, variant: str = "gqa", dtype: str = "float32", seed: int = 0):
    """Save a tiny random LlamaForCausalLM with its tokenizer; return the torch model."""
    return make_checkpoint(path, "LlamaConfig", "LlamaForCausalLM", LLAMA_VARIANTS[variant], dtype, seed)


def make_family_checkpoint(path, family: str, dtype: str = "float32", seed: int = 0):
    """Save a tiny random model of one of DENSE_FAMILIES; return the torch model."""
    return make_checkpoint(path, *DENSE_FAMILIES[family], dtype, seed)


def make_checkpoint(path, config_cls: str, model_cls: str, overrides: dict, dtype: str, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**TINY_LLAMA, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    # Larger-than-default weights give logits with real spread, so greedy ties are rare.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
            elif bool((p == 1).all()):  # norm weights: off 1, so a misplaced norm shows
                p.add_(torch.randn_like(p) * 0.1)
            else:  # biases
                p.normal_(0.0, 0.08)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    return model


def make_classifier(path, model_cls: str, labels: list[str], seed: int = 3):
    """A tiny random *ForSequenceClassification (score head over the last token): the torch model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config_cls = model_cls.replace("ForSequenceClassification", "Config")
    extra = {"head_dim": 24} if model_cls.startswith("Qwen3") else {}
    config = getattr(transformers, config_cls)(
        **{**TINY_LLAMA, **extra}, num_labels=len(labels), id2label=dict(enumerate(labels))
    )
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)  # logits with real spread
    model.save_pretrained(path)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    return model


# For subprocesses only (the test process itself runs without a persistent cache, see
# conftest.py): engines started with the same tiny model and shapes compile once per run.
TEST_XLA_CACHE = os.path.join(tempfile.gettempdir(), "jaxserve-test-xla-cache")


def engine_kwargs(**overrides):
    """Engine arguments for tiny models on this CPU: a small pool and two token buckets
    (decode-sized and the step's budget), so a test compiles each step variant twice at most."""
    kw = dict(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_gpu_blocks_override=64,
        block_size=8,
        enforce_eager=True,
        use_tqdm_on_load=False,
    )
    kw.update(overrides)
    budget = kw["max_num_batched_tokens"]
    kw.setdefault("compilation_config", {"cache_dir": "", "token_buckets": sorted({min(8, budget), budget})})
    return kw


def run_on_fake_devices(script: str, *args: str, devices: int = 8, timeout: float = 600) -> str:
    """`python -c script args` in a fresh process with `devices` fake CPU devices (the count is
    fixed when JAX starts) and this folder importable; its stdout, or the test fails with its
    stderr."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]
        ),
    }
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def make_lora_adapter(
    base, path, rank: int, alpha: float, targets, seed: int, rslora: bool = False, **config
):
    """Save a random PEFT LoRA adapter of the torch model `base` (random A and B, not peft's
    no-op start; `config`: more LoraConfig fields, e.g. lora_bias) at `path`; return the peft
    model with it."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=list(targets),
        init_lora_weights=False,
        **config,
    )
    model = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():  # LoRA biases start at zero even so: random ones, so they count
        for name, p in model.named_parameters():
            if "lora_B" in name and name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


def make_wordpiece_tokenizer():
    """A small BERT WordPiece tokenizer trained on the spot: [CLS] text [SEP], pairs as
    [CLS] a [SEP] b [SEP] with token types 0 then 1; its [SEP] is id 3."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(_CORPUS * 4, trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials))
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
        mask_token="[MASK]", model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )  # fmt: skip


def make_encoder_checkpoint(path, model_type: str = "bert", seed: int = 0, num_labels: int = 0):
    """Save a tiny random BertModel (or XLMRobertaModel; with num_labels, the
    *ForSequenceClassification of that many classes) with a WordPiece tokenizer; return the torch
    model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    tokenizer = make_wordpiece_tokenizer()
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=128)  # fmt: skip
    if num_labels:
        shape["num_labels"] = num_labels
    kind = "ForSequenceClassification" if num_labels else "Model"
    if model_type == "bert":
        config = transformers.BertConfig(**shape, type_vocab_size=2, pad_token_id=0, sep_token_id=3)
        model = getattr(transformers, "Bert" + kind)(config)
    else:  # RoBERTa's positions start at padding_idx + 1; one token type
        config = transformers.XLMRobertaConfig(**{**shape, "max_position_embeddings": 130}, type_vocab_size=1,
                                               pad_token_id=0, sep_token_id=3)  # fmt: skip
        model = getattr(transformers, "XLMRoberta" + kind)(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
            elif bool((p == 1).all()):
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, 0.08)
    model.eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def make_reward_model(path, process: bool = False, seed: int = 5):
    """A tiny random Qwen2ForRewardModel (or Qwen2ForProcessRewardModel): the Qwen2 layers, then
    the reward head nn.Sequential(Linear(h, h), ReLU(), Linear(h, labels)) as the published
    checkpoints' own code builds it (transformers has no class for them). Returns (the torch base
    model, the head as float64 arrays (w0, b0, w2, b2))."""
    import torch
    from safetensors.torch import load_file, save_file

    model = make_family_checkpoint(path, "qwen2", seed=seed)
    labels = 2 if process else 1
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    head = {
        "score.0.weight": torch.randn(hidden, hidden, generator=gen) * 0.2,
        "score.0.bias": torch.randn(hidden, generator=gen) * 0.2,
        "score.2.weight": torch.randn(labels, hidden, generator=gen) * 0.5,
        "score.2.bias": torch.randn(labels, generator=gen) * 0.5,
    }
    file = pathlib.Path(path) / "model.safetensors"
    tensors = {k: v for k, v in load_file(file).items() if not k.startswith("lm_head")}
    save_file({**tensors, **head}, file, metadata={"format": "pt"})
    config = json.loads((pathlib.Path(path) / "config.json").read_text())
    config["architectures"] = ["Qwen2ForProcessRewardModel" if process else "Qwen2ForRewardModel"]
    (pathlib.Path(path) / "config.json").write_text(json.dumps(config))
    return model.model, tuple(head[k].double().numpy() for k in head)


def make_modernbert(path, seed: int = 5):
    """A tiny random ModernBertModel (a global layer every second, local ones seeing 4 tokens
    either side) with the WordPiece tokenizer; return the torch model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    tokenizer = make_wordpiece_tokenizer()
    config = transformers.ModernBertConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        global_attn_every_n_layers=2, local_attention=8, max_position_embeddings=128, pad_token_id=0,
        bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
    )  # fmt: skip
    model = transformers.ModernBertModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model
