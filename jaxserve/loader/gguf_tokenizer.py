"""A GGUF file's tokenizer, rebuilt from its metadata with the ``tokenizers`` library alone.

Where it sits: ``loader/gguf.load_gguf_tokenizer`` reads the ``tokenizer.*`` metadata and hands it
here once per file (the result is cached on disk). transformers' own GGUF path reads the file with
torch, which a serving machine does not have; this builds the same tokenizer (same vocabulary,
merges, pre-tokenizer, special tokens and flags, checked id for id in the tests) without it.

llama.cpp names the tokenizer with ``tokenizer.ggml.model``: ``gpt2`` is byte-level BPE (SmolLM2,
Qwen2, Llama 3), ``llama`` is sentencepiece-style BPE with byte fallback (Llama 2, Mistral).
``tokenizer.ggml.pre`` names the regex the text is split with before BPE; a name not listed below
splits the way GPT-2 does, as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from jaxserve.loader.fast_tokenizer import FastTokenizer

# Bumped whenever what is built changes: converted tokenizers are cached on disk under it.
TOKENIZER_BUILD_VERSION = 2

# gguf.TokenType values (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}*{_LETTERS_LOWER}+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}+{_LETTERS_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}*{_LETTERS_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}+{_LETTERS_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the split regex its merges were learned with
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        [
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ],
        _LLAMA3_SPLIT,
    ),  # fmt: skip
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}


@dataclass(frozen=True)
class GGUFTokenizerMetadata:
    """The ``tokenizer.*`` keys of a GGUF file, as plain Python values."""

    model: str  # tokenizer.ggml.model
    tokens: list[str]
    token_types: list[int] = field(default_factory=list)
    merges: list[str] | None = None
    scores: list[float] | None = None
    pre: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unknown_token_id: int | None = None
    padding_token_id: int | None = None
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    chat_template: str | None = None

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def build_gguf_tokenizer(meta: GGUFTokenizerMetadata, name_or_path: str = "") -> FastTokenizer:
    """The tokenizer the engine uses (transformers' interface, loader/fast_tokenizer.py) around a
    ``tokenizers`` one.

    Raises ValueError for a tokenizer model this cannot build.
    """
    if meta.model == "gpt2":
        backend = _byte_level_bpe(meta)
    elif meta.model == "llama":
        backend = _sentencepiece_bpe(meta)
    else:
        raise ValueError(f"tokenizer.ggml.model {meta.model!r} is not supported (supported: gpt2, llama)")
    _add_marked_tokens(backend, meta)

    # A llama (sentencepiece) vocabulary without the flag gets BOS, as llama.cpp does.
    add_bos = meta.add_bos_token if meta.add_bos_token is not None else meta.model == "llama"
    add_eos = bool(meta.add_eos_token)
    bos, eos = meta.token(meta.bos_token_id), meta.token(meta.eos_token_id)
    backend.post_processor = _bos_eos_template(
        bos if add_bos else None, eos if add_eos else None, {bos: meta.bos_token_id, eos: meta.eos_token_id}
    )

    return FastTokenizer(
        backend,
        name_or_path=name_or_path,
        bos_token=bos,
        eos_token=eos,
        unk_token=meta.token(meta.unknown_token_id),
        pad_token=meta.token(meta.padding_token_id),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=meta.chat_template,
    )


def _byte_level_bpe(meta: GGUFTokenizerMetadata) -> Tokenizer:
    """GPT-2 style: every token spelled in the 256-character byte alphabet."""
    if meta.merges is None:
        raise ValueError("a gpt2 tokenizer needs tokenizer.ggml.merges")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(meta.tokens)
    }
    merges = [tuple(merge.split(" ")) for merge in meta.merges]
    backend = Tokenizer(
        models.BPE(
            vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(meta.pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: GGUFTokenizerMetadata) -> Tokenizer:
    """Llama 2 style: pieces with ``▁`` for spaces, unknown bytes as ``<0xNN>`` tokens."""
    vocab = {token: index for index, token in enumerate(meta.tokens)}
    if meta.merges is not None:
        merges = [tuple(merge.split(" ")) for merge in meta.merges]
    elif meta.scores is not None:
        merges = _merges_from_scores(vocab, dict(zip(meta.tokens, meta.scores)))
    else:
        raise ValueError("a llama tokenizer needs tokenizer.ggml.merges or tokenizer.ggml.scores")
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece vocabulary implies: every split of a token into two tokens,
    best-scored merged token first, then longer left and right parts (transformers' order)."""
    merges = []
    for merged, score in scores.items():
        pairs = [(merged[:i], merged[i:]) for i in range(1, len(merged))]
        pairs = [(left, right) for left, right in pairs if left in vocab and right in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, score) for left, right in pairs)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_marked_tokens(backend: Tokenizer, meta: GGUFTokenizerMetadata) -> None:
    """Control tokens (``<|im_end|>``) become special, user-defined ones (``<think>``) plain added
    tokens: both are matched whole in text, never cut into pieces.

    In a byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp
    mislabel; adding it would grow the vocabulary past the model's, so it is left out.
    """
    types = meta.token_types or []
    alphabet = set(_bytes_to_unicode().values()) if meta.model == "gpt2" else None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(meta.tokens, types)
        if token_type == _CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, token_type in zip(meta.tokens, types)
            if token_type == _USER_DEFINED and token in vocab
        ]
    )


def _bos_eos_template(bos: str | None, eos: str | None, ids: dict[str, int]) -> processors.TemplateProcessing:
    def wrap(sequence: str, type_id: int) -> list:
        return [
            *([f"{bos}:{type_id}"] if bos else []),
            f"${sequence}:{type_id}",
            *([f"{eos}:{type_id}"] if eos else []),
        ]

    specials = [(token, ids[token]) for token in (bos, eos) if token]
    return processors.TemplateProcessing(
        single=wrap("A", 0), pair=wrap("A", 0) + wrap("B", 1), special_tokens=specials
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the
    rest are shifted past 255 so that no token contains a space or a control character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping
