"""InputProcessor: from what a caller asks for to a checked ParentRequest, touching no queue.

Where it sits: the first step of a request inside the engine, before the Scheduler. Every
check that can refuse a request runs here (prompt length and ids, logprob limits, token ids in
logit_bias / allowed_token_ids / bad_words, the per-step mask budget), so a refused request
costs nothing downstream and a server can call this on its own thread (it reads only frozen
config and the tokenizer). It also fixes what each child sequence needs for its whole life:
its seed, its stop token ids (with the model's extra EOS ids), its device-slot contents.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.parent_request import ParentRequest
from jaxserve.engine.request import Request
from jaxserve.pooling_params import PooledSums, PoolingParams
from jaxserve.prompt_embeds import as_prompt_embeds, embedding_width
from jaxserve.reasoning import get_reasoning_parser
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.scheduler_output import MAX_BANNED_TOKENS, LogitsSpec
from jaxserve.structured_output import GrammarCompiler

if TYPE_CHECKING:
    from jaxserve.multimodal.images import RequestImages

PromptType = str | Sequence[int] | Mapping
# What a pooling request carries as sampling params: it samples nothing, and reports at its end.
_NEUTRAL = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        vocab_size: int,
        generation_config: Mapping,
        clock: Callable[[], float] = time.monotonic,
    ):
        """vocab_size: the model's output width (ids in logit_bias and friends must fit it).
        clock: the engine's, which stamps a request's arrival."""
        self.config = config
        self.clock = clock
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id, self.extra_eos_ids = self._eos_ids(generation_config)
        self._seed_rng = np.random.default_rng(config.model_config.seed)
        so = config.structured_outputs_config
        reasoning = get_reasoning_parser(so.reasoning_parser)(tokenizer) if so.reasoning_parser else None
        eos_ids = {self.eos_token_id, *self.extra_eos_ids} - {None}
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_ids, so, reasoning)
        mc = config.model_config
        self.image_prompts = None  # a vision-language model's (Pillow is imported for it only)
        if mc.is_multimodal:
            from jaxserve.multimodal.images import image_prompts_for

            self.image_prompts = image_prompts_for(
                mc.model, mc.hf_config, mc.mm_processor_kwargs, mc.limit_mm_per_prompt
            )

    def _eos_ids(self, generation_config: Mapping) -> tuple[int | None, set[int]]:
        """The tokenizer's eos, plus any other end-of-sequence ids the model or its
        generation config name (Llama 3 lists several), which stop like stop_token_ids."""
        ids = []
        for source in (self.config.model_config.hf_config, generation_config):
            eos = source.get("eos_token_id")
            ids += list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        primary = tok_eos if tok_eos is not None else (ids[0] if ids else None)
        return primary, {i for i in ids if i != primary}

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("Text prompts need a tokenizer (skip_tokenizer_init is set).")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def check_prompt_token_ids(self, token_ids: Sequence[int]) -> None:
        vocab = self.config.model_config.get("vocab_size")
        if vocab is not None and any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"Prompt token ids must be in [0, {vocab}).")

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> ParentRequest:
        """Check and tokenize a request and build its child sequences; ValueError on bad input."""
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError("priority is only honoured with scheduling_policy='priority'.")
        if self._pools(params):
            return self._pooling_request(request_id, prompt, params, priority, arrival_time)
        text, token_ids, embeds, images = self._prompt_tokens(prompt, params)
        room = self._check_prompt_length(token_ids)
        self._check_logprobs(params)
        # compiled here, before anything is queued: a bad schema fails the request, never a step
        grammar = (
            self.grammars.compile(params.structured_outputs)
            if params.structured_outputs is not None
            else None
        )
        spec, bad_words = self._logits_spec(params)
        self._check_masked(params, bad_words)
        best_of = params.best_of or params.n
        # the root of the prompt's prefix-cache chain: what its rows are beside its tokens
        digest = images.digest if images is not None else None
        digest = hashlib.sha256(embeds.tobytes()).digest() if embeds is not None else digest
        parent = ParentRequest(
            request_id,
            text,
            token_ids,
            [],
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            n=params.n,
            best_of=best_of,
            from_embeds=embeds is not None,
        )
        # a beam search step: the prompt's tokens from here on are output its grammar accepted
        start = prompt.get("structured_output_start") if isinstance(prompt, Mapping) else None
        for i in range(best_of):
            child = self._child(parent, i, params, priority, room)
            child.logits_spec, child.bad_words = spec, bad_words
            child.prompt_embeds, child.images, child.embeds_digest = embeds, images, digest
            if grammar is not None:
                matcher = grammar if i == 0 else grammar.deep_copy()
                prompt_ids, accepted = (
                    (token_ids, ()) if start is None else (token_ids[:start], token_ids[start:])
                )
                child.grammar = self.grammars.request_grammar(matcher, prompt_ids, accepted)
            parent.children.append(child)
            parent.logprob_dicts.append([])
            det = None
            if self.tokenizer is not None and child.sampling_params.detokenize:
                det = IncrementalDetokenizer(self.tokenizer, child)
            parent.detokenizers.append(det)
        return parent

    def _prompt_tokens(
        self, prompt: PromptType, params
    ) -> tuple[str | None, list[int], np.ndarray | None, object]:
        """(text, token ids, the prompt's embeddings if given so, its images' RequestImages)."""
        embeds = self._prompt_embeds(prompt, params)
        if embeds is not None:
            return None, [0] * len(embeds), embeds, None
        images = self._with_images(prompt)
        if images is not None:
            return *images[:2], None, images[2]
        return *self.tokenize_prompt(prompt), None, None

    def _pools(self, params: SamplingParams | PoolingParams) -> bool:
        """Whether the request is a pooling one; ValueError when the model serves the other kind."""
        pooling_model = self.config.model_config.runner_type == "pooling"
        if isinstance(params, PoolingParams) != pooling_model:
            raise ValueError(
                "This model is served for pooling (embeddings): it generates no text."
                if pooling_model
                else "This model is served for generation; embeddings need a pooling model (--runner pooling)."
            )
        return pooling_model

    def _prompt_embeds(self, prompt: PromptType, params) -> np.ndarray | None:
        """A prompt given as embeddings ({"prompt_embeds": array}): float32 [length, hidden], checked
        (vLLM's words where it has them); None for any other prompt."""
        if not (isinstance(prompt, Mapping) and "prompt_embeds" in prompt):
            return None
        mc = self.config.model_config
        if not mc.enable_prompt_embeds:
            raise ValueError("You must set `--enable-prompt-embeds` to input `prompt_embeds`.")
        if params.prompt_logprobs is not None:
            raise ValueError(
                "prompt_logprobs needs the prompt's token ids: a prompt given as embeddings has none."
            )
        return as_prompt_embeds(prompt["prompt_embeds"], embedding_width(mc.hf_config))

    def expand_images(self, prompt: Mapping) -> dict:
        """A prompt with images as it will run, without queueing it: its text, its tokens with
        the images' placeholders expanded (what the server counts and checks a request by), and
        the processed images ("expanded_images"); process() takes it as it is."""
        text, token_ids, images = self._with_images(prompt)
        return {"prompt": text, "prompt_token_ids": token_ids, "expanded_images": images}

    def _with_images(self, prompt: PromptType) -> tuple[str | None, list[int], RequestImages] | None:
        """A prompt with images ({"prompt" or "prompt_token_ids", "multi_modal_data": {"image":
        one or a list}}): its text, its tokens with each image's placeholder expanded, and where
        the images' rows go; None for a prompt without images."""
        if isinstance(prompt, Mapping) and "expanded_images" in prompt:  # (expand_images' own)
            return prompt.get("prompt"), list(prompt["prompt_token_ids"]), prompt["expanded_images"]
        data = prompt.get("multi_modal_data") if isinstance(prompt, Mapping) else None
        if not data:
            return None
        if self.image_prompts is None:
            raise ValueError(
                f"{self.config.model_config.architecture} is not a multimodal model: it takes no images."
            )
        if set(data) != {"image"}:
            raise ValueError(f"multi_modal_data: only 'image' inputs are supported, got {sorted(data)}.")
        images = data["image"]
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        for image in images:
            if not (hasattr(image, "convert") and hasattr(image, "tobytes")):
                raise ValueError(f"multi_modal_data images must be PIL images, got {type(image).__name__}.")
        if self.tokenizer is None:
            raise ValueError("Images need the tokenizer (skip_tokenizer_init is set).")
        text, token_ids = self.tokenize_prompt(prompt)
        token_ids, where = self.image_prompts.expand(token_ids, images, self.tokenizer)
        return text, token_ids, where

    def _pooling_request(
        self, request_id: str, prompt: PromptType, params: PoolingParams, priority: int, arrival_time
    ) -> ParentRequest:
        """A pooling request: its prompt (the last truncate_prompt_tokens of it, if asked), up to
        max_model_len tokens, run once; its dimensions and normalization resolved against the
        model's pooler (vLLM's checks and words)."""
        if isinstance(prompt, Mapping) and "prompt_embeds" in prompt:
            raise ValueError("prompt_embeds are served to generation models only.")
        text, token_ids = self.tokenize_prompt(prompt)
        mc = self.config.model_config
        params = _resolved_pooling(params, mc)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        if not token_ids:
            raise ValueError("The prompt is empty.")
        if len(token_ids) > mc.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {mc.max_model_len} tokens. However, you requested "
                f"{len(token_ids)} tokens in the input for embedding generation. Please reduce the length "
                "of the input."
            )
        self.check_prompt_token_ids(token_ids)
        arrival = self.clock() if arrival_time is None else arrival_time
        child = Request(
            request_id, token_ids, _NEUTRAL, seed=0, prompt=text, priority=priority, arrival_time=arrival,
            max_tokens=1,
        )  # fmt: skip
        child.pooling_params, child.pooled = params, PooledSums()
        return ParentRequest(request_id, text, token_ids, [child], [None], [[]], arrival_time=arrival)

    def _check_prompt_length(self, token_ids: list[int]) -> int:
        """A prompt of known tokens, with room for at least one more under max_model_len: the
        tokens left to generate."""
        if not token_ids:
            raise ValueError("The prompt is empty.")
        self.check_prompt_token_ids(token_ids)
        return self.config.model_config.room_after(len(token_ids))

    def _check_masked(self, params: SamplingParams, bad_words: tuple) -> None:
        """The tokens one step may mask for the request fit a row's banned-token slots."""
        masked = len(bad_words) + (
            len(set(params.stop_token_ids) | self.extra_eos_ids) + 1 if params.min_tokens else 0
        )
        if masked > MAX_BANNED_TOKENS:
            raise ValueError(
                f"At most {MAX_BANNED_TOKENS} token ids can be masked per step: min_tokens masks the EOS and "
                f"stop token ids, and each multi-token bad word one more; this request needs {masked}."
            )

    def _child(
        self, parent: ParentRequest, i: int, params: SamplingParams, priority: int, room: int
    ) -> Request:
        """Sample i of the parent (of best_of): its own seed (the request's + i when one is
        given), the model's extra EOS ids as stop ids, the prompt's pages shared with sample 0."""
        child_params = params.clone(n=1, best_of=None)
        if params.seed is not None:
            child_params.seed = params.seed + i
        child_params.stop_token_ids = sorted(set(child_params.stop_token_ids) | self.extra_eos_ids)
        seed = child_params.seed if child_params.seed is not None else int(self._seed_rng.integers(2**31))
        request_id = parent.request_id
        child = Request(
            request_id if parent.best_of == 1 else f"{i}_{request_id}",
            parent.prompt_token_ids,
            child_params,
            seed=seed,
            eos_token_id=self.eos_token_id,
            prompt=parent.prompt,
            priority=priority,
            arrival_time=parent.arrival_time,
            max_tokens=room if params.max_tokens is None else min(params.max_tokens, room),
        )
        child.wants_prompt_logprobs = params.prompt_logprobs is not None and i == 0  # once per request
        child.shares_prompt_with = parent.children[0] if i else None
        return child

    def _check_logprobs(self, params: SamplingParams) -> None:
        limit = self.config.model_config.max_logprobs
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            value = getattr(params, name)
            if value is not None and limit != -1 and (value == -1 or value > limit):
                raise ValueError(
                    f"Requested {what} logprobs of {value}, which is greater than max allowed: {limit} "
                    "(--max-logprobs)."
                )

    def _logits_spec(self, params: SamplingParams) -> tuple[LogitsSpec | None, tuple[tuple[int, ...], ...]]:
        """The request's device slot contents (None if it needs no slot) and its multi-token
        bad words; ValueError for token ids outside the vocabulary."""
        vocab = self.vocab_size

        def check(ids, what: str) -> None:
            bad = sorted({t for t in ids if not 0 <= t < vocab})
            if bad:
                raise ValueError(f"{what} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}.")

        bias = [(int(t), float(v)) for t, v in (params.logit_bias or {}).items()]
        check([t for t, _ in bias], "logit_bias")
        allowed = params.allowed_token_ids
        if allowed is not None:
            if not allowed:
                raise ValueError("allowed_token_ids must not be empty.")
            check(allowed, "allowed_token_ids")
            allowed = tuple(sorted(set(allowed)))
        multi: list[tuple[int, ...]] = []
        for ids in self.bad_words_token_ids(params.bad_words or []):
            if len(ids) == 1:
                bias.append((ids[0], -float("inf")))
            elif tuple(ids) not in multi:
                multi.append(tuple(ids))
        penalised = (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) != (
            0.0,
            0.0,
            1.0,
        )
        needs_slot = penalised or bias or allowed is not None
        return (LogitsSpec(tuple(bias), allowed) if needs_slot else None), tuple(multi)

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each bad word as the tokenizer writes it at the start of a text and, where that
        differs, after a space (vLLM's rule: the spaced form counts when it is as many tokens
        and starts with a different one)."""
        if words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer (skip_tokenizer_init is set).")
        out = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"bad_words entry {word!r} has no tokens.")
            out.append(plain)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                out.append(spaced)
        return out


# the request tasks each kind of pooling model serves, and what a refusal says
_SERVES = {
    "embed": ("embed", "encode", "score"),
    "classify": ("classify", "encode", "score"),
    "reward": ("reward", "encode"),
}
_SERVED_FOR = {"embed": "embeddings", "classify": "classification", "reward": "rewards"}
_NEEDS = {
    "embed": "embeddings need an embedding model",
    "classify": "classification needs a *ForSequenceClassification model",
    "reward": "rewards need a reward model (--convert reward)",
    "score": "scores need an embedding model or a cross-encoder",
}


def _resolved_pooling(params: PoolingParams, mc) -> PoolingParams:
    """The request's settings with the model's pooler defaults filled in; ValueError (vLLM's
    words) for dimensions the model was not trained to cut to or a truncation past its length."""
    pooler = mc.pooler_config
    name = mc.served_model_name[0] if mc.served_model_name else mc.model
    if params.task is not None and params.task not in _SERVES[pooler.task]:
        raise ValueError(f"This model is served for {_SERVED_FOR[pooler.task]}; {_NEEDS[params.task]}.")
    if pooler.pooling_type == "ALL" and params.task in ("embed", "score"):
        raise ValueError(
            "This model pools ALL (a vector per token): use encode (LLM.encode, /pooling); embeddings and "
            "scores need one vector per prompt."
        )
    if pooler.task in ("classify", "reward"):
        if params.dimensions is not None or params.normalize is not None:
            raise ValueError(
                f"dimensions and normalize apply to embeddings; this model is served for {_SERVED_FOR[pooler.task]}."
            )
        activation = pooler.activation if params.use_activation is None else params.use_activation
        return params.clone(use_activation=activation, truncate_prompt_tokens=_truncation(params, mc))
    dims = params.dimensions if params.dimensions is not None else pooler.dimensions
    if dims is not None:
        if not pooler.is_matryoshka:
            raise ValueError(
                f'Model "{name}" does not support matryoshka representation, changing output dimensions '
                "will lead to poor results."
            )
        if dims < 1:
            raise ValueError("Dimensions must be greater than 0")
        if pooler.matryoshka_dimensions and dims not in pooler.matryoshka_dimensions:
            raise ValueError(
                f'Model "{name}" only supports {list(pooler.matryoshka_dimensions)} matryoshka dimensions, '
                "use other output dimensions will lead to poor results."
            )
    normalize = pooler.normalize if params.normalize is None else params.normalize
    return params.clone(dimensions=dims, normalize=normalize, truncate_prompt_tokens=_truncation(params, mc))


def _truncation(params: PoolingParams, mc) -> int | None:
    """truncate_prompt_tokens resolved (-1: the model's length); ValueError past that length."""
    truncate = params.truncate_prompt_tokens
    if truncate is None:
        return None
    if truncate == -1:
        return mc.max_model_len
    if truncate < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or positive, got {truncate}.")
    if truncate > mc.max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len "
            f"({mc.max_model_len}). Please, select a smaller truncation size."
        )
    return truncate
