"""Vision-language serving costs on a shape-true SmolVLM-256M-Instruct: time to first token of an
image prompt (cold and warm encoder cache, against a text prompt of as many tokens), the image
encoder's throughput, and decode speed after an image prompt against after a text prompt.

The checkpoint is made once, without torch, in `--model-dir`: random float32 weights (normal, std
0.02; norms ones) under transformers' Idefics3ForConditionalGeneration names with SmolVLM-256M's
shapes (SmolLM2-135M decoder, untied head; SigLIP-base/16 at 512 px; pixel shuffle 4, so 64 tokens
a tile), SmolVLM's preprocessor_config.json (images to 2048 on the long side, 512-px tiles), and
the default model's tokenizer with the image tokens added and SmolVLM's chat template. The weights
are random, so the answers are noise; every cost measured here depends on the shapes alone.

In one engine (prefix caching off, one prefill a chunk), medians of `--reps` rounds, the requests
of a round alternating:
  - TTFT (max_tokens=1) of a 512x512 image and a short question, split as SmolVLM splits it (4x4
    tiles + the global image: 17 tiles) and as one tile (the split replaced by one that does not
    split), with the encoder cache cleared: the image processing (the input processor's
    image prompts' `expand`), the encoder (`runner.images._encode`) and the rest (the prefill);
  - the same request again, its image rows in the encoder cache;
  - a text prompt of as many tokens (random ids);
  - the encoder alone on one image's tiles (`_encode`), 1 and 17 tiles: tiles/s and images/s;
  - decode tok/s of `--decode-tokens` greedy tokens after the split image prompt and after its
    text twin.
`--tiny` runs the same code on a tiny random model (the benchmark's test). On a 2-core CPU the
full run takes about 7 minutes (a cold 17-tile first token is ~30 s); the checkpoint is 1 GB.

    python benchmarks/vlm.py [--model-dir DIR] [--reps 3] [--decode-tokens 128]
        [--output-json benchmarks/results/vlm_cpu_smolvlm256m_shape.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

# SmolVLM-256M-Instruct's shapes: the decoder is SmolLM2-135M (LlamaForCausalLM), the encoder
# SigLIP-base/16 at 512 px.
SMOLVLM_256M = {
    "text": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49280,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
    },
    "vision": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "image_size": 512,
        "patch_size": 16,
    },
    "scale_factor": 4,
    "longest_edge": 2048,
}
# The same structure, small: 64-px tiles of 8-px patches (16 tokens a tile), images to 256 on the
# long side (a 512x512 image: 4x4 tiles + the global one, as for SmolVLM).
TINY = {
    "text": {**SMOLVLM_256M["text"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    "vision": {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
               "image_size": 64, "patch_size": 8},
    "scale_factor": 2,
    "longest_edge": 256,
}  # fmt: skip

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
# SmolVLM's chat template: an image part is its <image> placeholder, where it stands in the text.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
QUESTION = "Can you describe this image in a few words?"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def default_model_dir(tiny: bool) -> str:
    name = "jaxserve-bench-vlm-tiny" if tiny else "jaxserve-bench-smolvlm256m-shape"
    return os.path.join(tempfile.gettempdir(), name)


def tensor_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    """transformers' Idefics3ForConditionalGeneration tensor names and shapes ([out, in])."""
    t, v = shape["text"], shape["vision"]
    h, m, hd = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    d, vm, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    shapes = {"lm_head.weight": (t["vocab_size"], h), "model.text_model.embed_tokens.weight": (t["vocab_size"], h),
              "model.text_model.norm.weight": (h,)}  # fmt: skip
    for i in range(t["num_hidden_layers"]):
        pre = f"model.text_model.layers.{i}."
        shapes |= {
            pre + "input_layernorm.weight": (h,),
            pre + "post_attention_layernorm.weight": (h,),
            pre + "self_attn.q_proj.weight": (q, h),
            pre + "self_attn.k_proj.weight": (kv, h),
            pre + "self_attn.v_proj.weight": (kv, h),
            pre + "self_attn.o_proj.weight": (h, q),
            pre + "mlp.gate_proj.weight": (m, h),
            pre + "mlp.up_proj.weight": (m, h),
            pre + "mlp.down_proj.weight": (h, m),
        }
    vis = "model.vision_model."
    shapes |= {
        vis + "embeddings.patch_embedding.weight": (d, 3, p, p),
        vis + "embeddings.patch_embedding.bias": (d,),
        vis + "embeddings.position_embedding.weight": ((v["image_size"] // p) ** 2, d),
        vis + "post_layernorm.weight": (d,),
        vis + "post_layernorm.bias": (d,),
        "model.connector.modality_projection.proj.weight": (h, d * shape["scale_factor"] ** 2),
    }
    for i in range(v["num_hidden_layers"]):
        pre = f"{vis}encoder.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= {f"{pre}self_attn.{n}.weight": (d, d), f"{pre}self_attn.{n}.bias": (d,)}
        shapes |= {pre + "mlp.fc1.weight": (vm, d), pre + "mlp.fc1.bias": (vm,)}
        shapes |= {pre + "mlp.fc2.weight": (d, vm), pre + "mlp.fc2.bias": (d,)}
        for n in ("layer_norm1", "layer_norm2"):
            shapes |= {f"{pre}{n}.weight": (d,), f"{pre}{n}.bias": (d,)}
    return shapes


def hf_tensors(shape: dict, rng) -> dict:
    """Random float32 tensors (normal, std 0.02; norms ones, their biases zeros)."""
    import numpy as np

    tensors = {}
    for name, s in tensor_shapes(shape).items():
        if "norm" in name and name.endswith(".weight"):
            tensors[name] = np.ones(s, np.float32)
        elif "norm" in name:  # a layer norm's bias
            tensors[name] = np.zeros(s, np.float32)
        else:
            x = rng.standard_normal(s, dtype=np.float32)
            x *= 0.02
            tensors[name] = x
    return tensors


def make_tokenizer(gguf: str):
    """The GGUF file's tokenizer with SmolVLM's image tokens added as special tokens and its chat
    template."""
    from tokenizers import AddedToken, Tokenizer

    from jaxserve.loader.fast_tokenizer import FastTokenizer
    from jaxserve.loader.gguf import load_gguf_tokenizer

    base = load_gguf_tokenizer(gguf)
    backend = Tokenizer.from_str(base.backend_tokenizer.to_str())  # a copy: the loader may share its own
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS])
    return FastTokenizer(
        backend,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        unk_token=base.unk_token,
        pad_token=base.pad_token,
        add_bos_token=base.add_bos_token,
        add_eos_token=base.add_eos_token,
        chat_template=SMOLVLM_CHAT_TEMPLATE,
    )


def build_checkpoint(directory: str, shape: dict, tokenizer_gguf: str, seed: int = 0) -> str:
    """The checkpoint in `directory`, made there first unless a complete one is there already."""
    import numpy as np
    from safetensors.numpy import save_file

    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    tokenizer = make_tokenizer(tokenizer_gguf)
    vocab = shape["text"]["vocab_size"]
    if len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's {vocab}")
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    text = {
        "model_type": "llama",
        **shape["text"],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.convert_tokens_to_ids(tokenizer.bos_token),
        "eos_token_id": tokenizer.convert_tokens_to_ids(tokenizer.eos_token),
    }
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "torch_dtype": "float32",
        "image_token_id": image_token_id,
        "scale_factor": shape["scale_factor"],
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "text_config": text,
        "vision_config": {
            "model_type": "idefics3_vision",
            **shape["vision"],
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
            "hidden_act": "gelu_pytorch_tanh",
        },
    }
    preprocessor = {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": shape["longest_edge"]},
        "resample": 1,  # LANCZOS
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": shape["vision"]["image_size"]},
    }
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        save_file(hf_tensors(shape, np.random.default_rng(seed)), os.path.join(tmp, "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "preprocessor_config.json"), "w") as fh:
            json.dump(preprocessor, fh, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(config, fh, indent=2)
        os.chmod(tmp, 0o755)
        os.replace(tmp, directory)
        os.makedirs(tmp)  # (for the context manager to remove)
    return directory


class Stopwatch:
    """Wraps a callable so that each call's seconds are recorded."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - start)

    def take(self) -> float:
        total, self.seconds = sum(self.seconds), []
        return total


def median_of(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def machine() -> dict:
    import jax

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()  # fmt: skip
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            ).stdout.strip()  # fmt: skip
        )
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
        "git_commit": commit,
        "git_dirty": dirty,
    }


def run(ns: argparse.Namespace) -> dict:
    import dataclasses

    import jax
    import numpy as np
    from PIL import Image

    from jaxserve import LLM, SamplingParams
    from jaxserve.sampling_params import RequestOutputKind

    shape = TINY if ns.tiny else SMOLVLM_256M
    load_at_start = os.getloadavg()[0]
    gguf = ns.tokenizer_gguf
    if gguf is None:
        from jaxserve.loader.default_model import default_model_path

        gguf = default_model_path()
    start = time.perf_counter()
    model_dir = build_checkpoint(os.path.expanduser(ns.model_dir or default_model_dir(ns.tiny)), shape, gguf)
    build_s = time.perf_counter() - start
    log(f"checkpoint {model_dir} ({build_s:.1f} s)")

    start = time.perf_counter()
    llm = LLM(model=model_dir, max_model_len=ns.max_model_len, max_num_batched_tokens=ns.max_num_batched_tokens,
              max_num_seqs=ns.max_num_seqs, enable_prefix_caching=False, enforce_eager=ns.enforce_eager,
              use_tqdm_on_load=False, compilation_config={"cache_dir": ""})  # fmt: skip
    startup_s = time.perf_counter() - start
    log(f"engine started ({startup_s:.1f} s)")
    engine = llm.llm_engine
    runner, processor = engine.runner, engine.input_processor
    encoder = runner.images
    split_prompts = processor.image_prompts
    with open(os.path.join(model_dir, "preprocessor_config.json")) as fh:
        preprocessor = json.load(fh)
    # the same image prompts without the split (as `--mm-processor-kwargs` would make them)
    one_tile_prompts = type(split_prompts)(
        engine.config.model_config.hf_config, preprocessor, {"do_image_splitting": False}, split_prompts.limit
    )
    # the parts of a request's first token: image processing and the encoder, timed where they run
    expand = {id(p): Stopwatch(p.expand) for p in (split_prompts, one_tile_prompts)}
    for p in (split_prompts, one_tile_prompts):
        p.expand = expand[id(p)]
    encode = encoder._encode = Stopwatch(encoder._encode)

    compiles = []  # backend compiles once timing starts (none expected: every shape is warmed)
    timing = [False]

    def on_compile(event: str, secs: float, **_) -> None:
        if timing[0] and event == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)

    jax.monitoring.register_event_duration_secs_listener(on_compile)

    image = Image.fromarray(
        np.random.default_rng(1).integers(0, 256, (ns.image_size, ns.image_size, 3), np.uint8)
    )
    tokenizer = llm.get_tokenizer()
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt_text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    image_prompt = {"prompt": prompt_text, "multi_modal_data": {"image": image}}
    counter = itertools.count()

    def request(prompt, max_tokens: int, kind: str = "split") -> dict:
        """One request through the engine's loop: seconds to its first token and to its end, with
        the image processing and encoder seconds it took."""
        processor.image_prompts = split_prompts if kind == "split" else one_tile_prompts
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)  # fmt: skip
        expand[id(processor.image_prompts)].take()
        encode.take()
        begin = time.perf_counter()
        engine.add_request(f"vlm-{next(counter)}", prompt, params)
        first = final = None
        tokens, prompt_len = 0, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids and first is None:
                    first = time.perf_counter()
                tokens += len(out.outputs[0].token_ids) if out.outputs else 0
                prompt_len = len(out.prompt_token_ids) if out.prompt_token_ids else prompt_len
                if out.finished:
                    final = time.perf_counter()
        assert first is not None and final is not None and tokens == max_tokens, (tokens, max_tokens)
        processing_s = expand[id(processor.image_prompts)].take()
        encoder_s = encode.take()
        ttft = first - begin
        return {
            "ttft_s": ttft,
            "image_processing_s": processing_s,
            "encoder_s": encoder_s,
            "rest_s": ttft - processing_s - encoder_s,
            "decode_s": final - first,
            "prompt_tokens": prompt_len,
        }

    rng = np.random.default_rng(0)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]  # (no added token: no image's)

    def text_twin(kind: str) -> dict:
        """A text prompt of as many tokens as the image prompt (random ids, none an image token)."""
        n = request(image_prompt, 1, kind)["prompt_tokens"]  # (also the warm-up of this shape)
        return {"prompt_token_ids": rng.choice(vocab, n).tolist()}

    # warm-up: every shape below once (compiles with enforce_eager; the encoder's first call)
    twins = {}
    for kind in ("split", "one_tile"):
        encoder._cache.clear()
        twins[kind] = text_twin(kind)
        request(image_prompt, 1, kind)  # warm cache
        request(twins[kind], 1)
    request(image_prompt, ns.decode_tokens, "split")
    request(twins["split"], ns.decode_tokens)

    # the image as the encoder takes it, split and not
    items = {
        kind: p.expand([p.image_token_id], [image], tokenizer)[1].items[0]
        for kind, p in (("one_tile", one_tile_prompts), ("split", split_prompts))
    }
    tiles = {kind: item.num_rows // split_prompts.rows_per_tile for kind, item in items.items()}

    def encode_alone(kind: str) -> float:
        item = dataclasses.replace(items[kind], digest=os.urandom(32))  # never in the cache
        start = time.perf_counter()
        encoder._encode(runner.state, [item])
        seconds = time.perf_counter() - start
        encoder._cache.pop(item.digest)
        encode.take()
        return seconds

    for kind in tiles:
        encode_alone(kind)

    log("warmed up")
    timing[0] = True
    hits, misses = encoder.hits, encoder.misses
    rows = {f"{k}_{p}": [] for k in ("split", "one_tile") for p in ("cold", "warm", "text")}
    encoder_s = {kind: [] for kind in tiles}
    decode = {"after_image": [], "after_text": []}
    for i in range(ns.reps):
        for kind in ("split", "one_tile"):
            encoder._cache.clear()
            rows[f"{kind}_cold"].append(request(image_prompt, 1, kind))
            rows[f"{kind}_warm"].append(request(image_prompt, 1, kind))
            rows[f"{kind}_text"].append(request(twins[kind], 1))
            if kind == "split":  # (its image rows still cached: the first token is the prefill's)
                decode["after_image"].append(request(image_prompt, ns.decode_tokens, "split"))
                decode["after_text"].append(request(twins["split"], ns.decode_tokens))
        for kind in tiles:
            encoder_s[kind].append(encode_alone(kind))
        log(f"round {i + 1}/{ns.reps}: cold {rows['split_cold'][-1]['ttft_s']:.2f} s, "
            f"warm {rows['split_warm'][-1]['ttft_s']:.2f} s, text {rows['split_text'][-1]['ttft_s']:.2f} s")  # fmt: skip
    timing[0] = False
    jax.monitoring.unregister_event_duration_listener(on_compile)

    report = {
        "config": vars(ns),
        "machine": machine(),
        "model": {
            "dir": model_dir,
            "shape": "tiny" if ns.tiny else "SmolVLM-256M-Instruct",
            "params": param_counts(shape),
            "tokens_per_tile": split_prompts.rows_per_tile,
            "tiles": tiles,
        },
        "build_checkpoint_s": build_s,
        "startup_s": startup_s,
        "ttft": {},
        "encoder": {},
    }
    for kind in ("split", "one_tile"):
        cold, warm, text = (median_of(rows[f"{kind}_{p}"]) for p in ("cold", "warm", "text"))
        report["ttft"][kind] = {
            "prompt_tokens": int(cold["prompt_tokens"]),
            "cold": {k: v for k, v in cold.items() if k not in ("decode_s", "prompt_tokens")},
            "warm": {k: v for k, v in warm.items() if k not in ("decode_s", "prompt_tokens")},
            "text_s": text["ttft_s"],
            "warm_over_cold": warm["ttft_s"] / cold["ttft_s"],
            "cold_over_text": cold["ttft_s"] / text["ttft_s"],
            "warm_over_text": warm["ttft_s"] / text["ttft_s"],
            "encoder_share_cold": cold["encoder_s"] / cold["ttft_s"],
            "times": {p: [r["ttft_s"] for r in rows[f"{kind}_{p}"]] for p in ("cold", "warm", "text")},
        }
    for kind, times in encoder_s.items():
        seconds = statistics.median(times)
        report["encoder"][kind] = {
            "tiles": tiles[kind],
            "s_per_image": seconds,
            "tiles_per_s": tiles[kind] / seconds,
            "images_per_s": 1 / seconds,
            "times": times,
        }
    steps = ns.decode_tokens - 1
    tok_s = {k: statistics.median(steps / r["decode_s"] for r in v) for k, v in decode.items()}
    report["decode"] = {
        "tokens": ns.decode_tokens,
        "after_image_tok_per_s": tok_s["after_image"],
        "after_text_tok_per_s": tok_s["after_text"],
        "image_over_text": tok_s["after_image"] / tok_s["after_text"],
        "times": {k: [r["decode_s"] for r in v] for k, v in decode.items()},
    }
    report["encoder_cache"] = {"hits": encoder.hits - hits, "misses": encoder.misses - misses}
    report["compiles_during_timing"] = {"count": len(compiles), "seconds": sum(compiles)}
    # (other work on the machine shows here: on 2 cores a load above ~2 is someone else's)
    report["machine"]["load_average_1m"] = {"start": load_at_start, "end": os.getloadavg()[0]}
    return report


def param_counts(shape: dict) -> dict:
    """Parameters of the decoder (embedding and head included), the encoder and the connector."""
    counts = {"text": 0, "vision": 0, "connector": 0}
    for name, dims in tensor_shapes(shape).items():
        part = "connector" if "connector" in name else "vision" if "vision_model" in name else "text"
        n = 1
        for d in dims:
            n *= d
        counts[part] += n
    return counts


def print_table(report: dict) -> None:
    print(f"{report['model']['shape']}: {report['model']['params']}, startup {report['startup_s']:.1f} s")
    print("TTFT (s)      tokens  cold  (processing / encoder / rest)   warm  text  warm/cold  cold/text")
    for kind, r in report["ttft"].items():
        c, w = r["cold"], r["warm"]
        print(
            f"{kind:12s} {r['prompt_tokens']:6d} {c['ttft_s']:6.3f}  ({c['image_processing_s']:.3f} / "
            f"{c['encoder_s']:.3f} / {c['rest_s']:.3f}) {w['ttft_s']:6.3f} {r['text_s']:6.3f}"
            f"  {r['warm_over_cold']:8.2f}  {r['cold_over_text']:8.2f}"
        )
    for kind, r in report["encoder"].items():
        print(
            f"encoder {kind:9s} {r['tiles']:3d} tiles: {r['s_per_image']:.3f} s/image, "
            f"{r['tiles_per_s']:.2f} tiles/s, {r['images_per_s']:.3f} images/s"
        )
    d = report["decode"]
    print(
        f"decode: {d['after_image_tok_per_s']:.1f} tok/s after the image prompt, {d['after_text_tok_per_s']:.1f} "
        f"after the text prompt ({d['image_over_text']:.2f}x)"
    )
    print(f"compiles while timing: {report['compiles_during_timing']['count']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir", default=None, help="where the checkpoint is made once (default: temp dir)"
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same structure")
    parser.add_argument(
        "--tokenizer-gguf",
        default=None,
        help="the GGUF file whose tokenizer is used (default: the default model)",
    )
    parser.add_argument("--image-size", type=int, default=512, help="the image's side in pixels")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="(one prefill is one chunk)")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    report = run(ns)
    print_table(report)
    if ns.output_json:
        with open(ns.output_json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
