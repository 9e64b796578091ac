"""One entry point for tokenizers, whatever the checkpoint format.

Where it sits: called once at engine start-up (``load_tokenizer``, by the engine) to get the
tokenizer that the chat template, request tokenization and the detokenizer all share. A ``.gguf``
file carries its own tokenizer in its metadata; anything else goes to transformers (a local Hugging
Face directory, or a hub id where the hub is reachable).
"""

from __future__ import annotations

import logging
import os

from jaxserve.config import ModelConfig
from jaxserve.loader.gguf import load_gguf_tokenizer

logger = logging.getLogger(__name__)


def load_tokenizer(model_config: ModelConfig):
    """The model's tokenizer, or None when the engine runs on token ids alone (skip_tokenizer_init)."""
    mc = model_config
    if mc.skip_tokenizer_init:
        return None
    return get_tokenizer(mc.tokenizer, revision=mc.tokenizer_revision, trust_remote_code=mc.trust_remote_code)


def get_tokenizer(path: str, *, revision: str | None = None, trust_remote_code: bool = False):
    """A Hugging Face fast tokenizer for ``path`` (a model directory, hub id, or ``.gguf`` file).

    Every failure becomes a ValueError naming ``path``, so the CLI can print one line and exit.
    """
    if path.startswith("~"):
        path = os.path.expanduser(path)
    if path.lower().endswith(".gguf"):
        return load_gguf_tokenizer(path)
    if _looks_like_local_path(path) and not os.path.exists(path):
        raise ValueError(f"{path}: no such file or directory")

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, revision=revision, trust_remote_code=trust_remote_code
        )
    except Exception as err:  # OSError, ValueError, hub errors...: the caller needs one type
        raise ValueError(f"{path}: no usable tokenizer ({type(err).__name__}: {err})") from err
    if not getattr(tokenizer, "is_fast", False):
        # Incremental detokenization and offsets are much slower through a Python tokenizer.
        logger.warning("%s: loaded a slow (Python) tokenizer %s", path, type(tokenizer).__name__)
    return tokenizer


def _looks_like_local_path(path: str) -> bool:
    """A hub id is ``org/name``: an absolute or dot-relative path is never sent to the hub."""
    return os.path.isabs(path) or path.startswith(".")
