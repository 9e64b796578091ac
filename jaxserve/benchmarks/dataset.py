"""The prompts the serving benchmark sends: vLLM's random dataset.

Where it sits: first in the flow, before any request. The served model's tokenizer turns random
token ids into prompt text whose token count is known, so the report's input token totals and the
server's prefill work match what was asked for. Only the random dataset exists; ``DATASETS`` is
what the command line accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.benchmarks.benchmark_error import BenchmarkError

DATASETS = ("random",)
# Decode/encode round trips spent steering a random prompt onto its token count.
_LENGTH_ROUNDS = 10


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


def sample_random_requests(
    tokenizer,
    num_prompts: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts of random token ids decoded to text, as vLLM's random dataset.

    Random ids make prompts whose length is known and whose prefix no cache can share (except the
    deliberate shared prefix of ``prefix_len`` tokens). Lengths are drawn uniformly from
    length * (1 +- range_ratio). Each prompt's recorded length is that of the text actually sent,
    re-encoded; it matches the drawn length unless the round trip never settles (byte-level
    vocabularies full of partial characters), and is then the closest shorter one found.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    vocab = _ordinary_token_ids(tokenizer)
    input_lens = _random_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _random_lengths(rng, output_len, range_ratio, num_prompts)
    prefix = rng.choice(vocab, size=prefix_len)
    samples = []
    for n_in, n_out in zip(input_lens, output_lens):
        ids = np.concatenate([prefix, rng.choice(vocab, size=int(n_in))])
        prompt, prompt_len = _decode_to_length(tokenizer, ids, prefix_len + int(n_in), vocab, rng)
        samples.append(SampleRequest(prompt, prompt_len, int(n_out)))
    return samples


def _ordinary_token_ids(tokenizer) -> np.ndarray:
    """All ids but the special ones, which a server may strip or treat as end of text."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def _random_lengths(rng: np.random.Generator, length: int, range_ratio: float, n: int) -> np.ndarray:
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def _decode_to_length(
    tokenizer, ids: np.ndarray, target: int, vocab: np.ndarray, rng: np.random.Generator
) -> tuple[str, int]:
    """Text that re-encodes to ``target`` tokens, or else the closest shorter one a few rounds found
    (the last one tried if none was shorter), with its true token count.

    Decoding random ids and encoding the text again merges some tokens and splits others (cut
    byte sequences decode to wider replacement characters), so the ids are topped up with fresh
    random ones, or cut by the overshoot, until the round trip lands on the target.
    """
    best = None
    for _ in range(_LENGTH_ROUNDS):
        text = tokenizer.decode(ids.tolist())
        reencoded = np.asarray(encode(tokenizer, text), dtype=np.int64)
        length = len(reencoded)
        if length == target:
            return text, length
        if length < target:
            if best is None or length > best[1]:
                best = (text, length)
            ids = np.concatenate([reencoded, rng.choice(vocab, size=target - length)])
        else:
            ids = reencoded[: max(1, 2 * target - length)]
    return best or (text, length)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as the server counts a prompt's own tokens: no BOS or other specials."""
    return tokenizer.encode(text, add_special_tokens=False)


def load_tokenizer(name: str):
    """The tokenizer for ``name``, found locally only (a directory, a .gguf file or the HF cache).

    The default model is served under its hub name but stored here as a GGUF file, so that name
    falls back to the file when the hub cache does not have it.
    """
    from jaxserve.loader.default_model import DEFAULT_MODEL_NAME
    from jaxserve.loader.tokenizer import get_tokenizer
    from jaxserve.model_resolution import resolve_model_path

    try:
        path = resolve_model_path(name)
    except ValueError as err:
        if name != DEFAULT_MODEL_NAME:
            raise BenchmarkError(f"tokenizer: {err} Pass --tokenizer with a local path.", 2) from None
        try:
            path = resolve_model_path(None)
        except ValueError as fetch_err:
            raise BenchmarkError(f"tokenizer for {name}: {fetch_err}", 2) from None
    try:
        return get_tokenizer(path)
    except ValueError as err:
        raise BenchmarkError(f"tokenizer: {err}", 2) from None
