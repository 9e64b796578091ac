"""A tokenizer on the ``tokenizers`` library alone, with the part of transformers' interface jaxserve uses.

Where it sits: what `loader/tokenizer.get_tokenizer` returns for a GGUF file (built by
``loader/gguf_tokenizer.py``, cached on disk by ``loader/gguf.py``); the engine, the detokenizer,
the chat template and the servers use it as they use a transformers fast tokenizer. transformers
itself is not imported: that alone costs more than a warm start's every other step. What it
saves loads back with transformers' ``AutoTokenizer`` too (a converted checkpoint's tokenizer),
and the tests hold both to the same ids, text and chat output.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import Tokenizer

from jaxserve.loader.chat_template import render_chat_template

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_CONFIG_FILE, _TEMPLATE_FILE, _TOKENIZER_FILE = (
    "tokenizer_config.json",
    "chat_template.jinja",
    "tokenizer.json",
)
# transformers' clean_up_tokenization: spaces before punctuation and contractions removed.
_CLEAN_UPS = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
              (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]  # fmt: skip


class FastTokenizer:
    is_fast = True  # the detokenizer's question: special tokens join as the decoder joins them

    def __init__(
        self,
        backend: Tokenizer,
        *,
        name_or_path: str = "",
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
    ):
        self.backend_tokenizer = backend
        self.name_or_path = name_or_path
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = (
            bos_token,
            eos_token,
            unk_token,
            pad_token,
        )
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.chat_template = chat_template

    # ---- vocabulary --------------------------------------------------------------------------

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    bos_token_id = property(lambda self: self._id(self.bos_token))
    eos_token_id = property(lambda self: self._id(self.eos_token))
    unk_token_id = property(lambda self: self._id(self.unk_token))
    pad_token_id = property(lambda self: self._id(self.pad_token))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in _SPECIAL_TOKEN_NAMES if getattr(self, name) is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self._id(token) for token in self.all_special_tokens]

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' meaning)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    # ---- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        ids: int | Iterable[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool = False,
    ) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces:
            for before, after in _CLEAN_UPS:
                text = text.replace(before, after)
        return text

    def convert_ids_to_tokens(self, ids: int | Iterable[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skipped = set(self.all_special_ids) if skip_special_tokens else ()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skipped]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]):
        if isinstance(tokens, str):
            return self._id(tokens)
        return [self._id(t) for t in tokens]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.backend_tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    # ---- chat --------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: list,
        tools: list | None = None,
        documents: list | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs,
    ):
        """transformers' apply_chat_template for one conversation or a list of them: the text, or
        with `tokenize` its ids (in a dict under ``input_ids`` when `return_dict`)."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("This tokenizer has no chat template; pass chat_template.")
        if not conversation:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        batched = isinstance(conversation[0], (list, tuple))
        variables = {**self.special_tokens_map, **kwargs}
        results = []
        for chat in conversation if batched else [conversation]:
            text = render_chat_template(
                template, chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **variables,
            )  # fmt: skip
            if tokenize:
                ids = self.encode(text, add_special_tokens=False)
                text = {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids
            results.append(text)
        return results if batched else results[0]

    # ---- files -------------------------------------------------------------------------------

    def save_pretrained(self, directory: str) -> None:
        """tokenizer.json, tokenizer_config.json and chat_template.jinja, as transformers writes them."""
        os.makedirs(directory, exist_ok=True)
        self.backend_tokenizer.save(os.path.join(directory, _TOKENIZER_FILE))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens_map,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "clean_up_tokenization_spaces": False,
        }
        with open(os.path.join(directory, _CONFIG_FILE), "w", encoding="utf-8") as fh:
            json.dump(config, fh, indent=2, ensure_ascii=False)
        if self.chat_template is not None:
            with open(os.path.join(directory, _TEMPLATE_FILE), "w", encoding="utf-8") as fh:
                fh.write(self.chat_template)

    @classmethod
    def from_directory(cls, directory: str, name_or_path: str = "") -> FastTokenizer:
        """What `save_pretrained` wrote."""
        backend = Tokenizer.from_file(os.path.join(directory, _TOKENIZER_FILE))
        with open(os.path.join(directory, _CONFIG_FILE), encoding="utf-8") as fh:
            config = json.load(fh)
        template_path = os.path.join(directory, _TEMPLATE_FILE)
        chat_template = None
        if os.path.exists(template_path):
            with open(template_path, encoding="utf-8") as fh:
                chat_template = fh.read()
        return cls(
            backend,
            name_or_path=name_or_path or directory,
            **{name: config.get(name) for name in _SPECIAL_TOKEN_NAMES},
            add_bos_token=bool(config.get("add_bos_token")),
            add_eos_token=bool(config.get("add_eos_token")),
            chat_template=chat_template,
        )
