"""What the completion and chat handlers share: model names, prompt lengths, request
logging, running several prompts at once and the usage block.

Where it sits: between protocol.py (validated bodies) and the AsyncLLMEngine. Each
endpoint's handler is an OpenAIServing; how a conversation becomes a prompt
(chat_prompt.py), how logprobs are shaped (logprobs.py) and how a stream is framed
(sse.py) live in their own modules. Every client mistake found here is a ValueError (the
app turns it into a 400) or a ModelNotFound (404); nothing here touches the engine's
queues directly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from aiohttp import web

from jaxserve.beam_search import BeamSearch, BeamSearchParams
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.entrypoints.openai.chat_prompt import render_chat_prompt, server_chat_template
from jaxserve.entrypoints.openai.logprobs import LogprobFormatter
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    TokenizeChatRequest,
    _SamplingRequest,
    bad_request,
    random_id,
)
from jaxserve.entrypoints.openai.server_args import ServerArgs
from jaxserve.entrypoints.openai.stream_merge import merge_streams
from jaxserve.lora.modules import LoRAModules
from jaxserve.multimodal import image_placeholder
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.prompt_embeds import as_prompt_embeds, decode_tensor, embedding_width
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("jaxserve.entrypoints.openai")

Prompt = dict  # {"prompt": text | None, "prompt_token_ids": [...]} as the engine takes it


class ModelNotFound(LookupError):
    pass


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, args: ServerArgs, loras: LoRAModules | None = None):
        self.engine = engine
        self.args = args
        self.tokenizer = engine.tokenizer
        self.model_config = engine.config.model_config
        self.max_model_len = self.model_config.max_model_len
        self.served_model_names = list(self.model_config.served_model_name)
        self.loras = loras if loras is not None else LoRAModules()  # adapters served by name
        self.sampling_defaults = dict(engine.sampling_defaults)
        self.chat_template = server_chat_template(args.chat_template, self.tokenizer)
        self.logprob_formatter = LogprobFormatter(self.tokenizer)

    # ---- checks --------------------------------------------------------------------------

    def model_name(self, requested: str | None) -> str:
        """The model a request names: a served name of the base model or a LoRA adapter's."""
        if requested is None or requested in self.served_model_names or self.loras.get(requested):
            return requested or self.served_model_names[0]
        raise ModelNotFound(f"The model `{requested}` does not exist.")

    def require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("This server was started with --skip-tokenizer-init: send token ids, not text.")
        return self.tokenizer

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """The request's max_tokens, checked against the context length like vLLM does."""
        limit = self.max_model_len
        room = self.model_config.room_after(prompt_len)
        if requested is None:
            default = self.sampling_defaults.get("max_tokens")
            return room if default is None else min(room, default)
        if prompt_len + requested > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        return requested

    async def check_structured_outputs(
        self, params: StructuredOutputsParams | None, field: str | None
    ) -> None:
        """Compile the request's grammar off the event loop (and off the engine's thread, which
        keeps stepping); a bad schema, regex or grammar is a 400 naming `field`."""
        if params is None:
            return
        try:
            await asyncio.to_thread(self.engine.check_structured_outputs, params)
        except ValueError as e:
            raise bad_request(f"{field}: {e}" if field else str(e), field) from None

    # ---- prompts -------------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool, truncate: int | None = None) -> Prompt:
        ids = self.require_tokenizer().encode(text, add_special_tokens=add_special_tokens)
        return {"prompt": text, "prompt_token_ids": ids[-truncate:] if truncate else ids}

    def token_prompt(self, ids: Sequence[int], truncate: int | None = None) -> Prompt:
        self.engine.check_prompt_token_ids(ids)  # before the tokenizer sees them
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
        ids = list(ids)
        return {"prompt": text, "prompt_token_ids": ids[-truncate:] if truncate else ids}

    def embeds_prompt(self, data: str, truncate: int | None = None) -> Prompt:
        """A prompt given as embeddings (a base64 torch.save tensor, vLLM's wire format): its last
        `truncate` rows if asked; token ids as placeholders, for its length."""
        if not self.model_config.enable_prompt_embeds:
            raise ValueError("You must set `--enable-prompt-embeds` to input `prompt_embeds`.")
        embeds = as_prompt_embeds(decode_tensor(data), embedding_width(self.model_config.hf_config))
        embeds = embeds[-truncate:] if truncate else embeds
        return {"prompt": None, "prompt_token_ids": [0] * len(embeds), "prompt_embeds": embeds}

    def render_chat(self, body: ChatCompletionRequest | TokenizeChatRequest) -> str:
        """The conversation as the prompt text the model's chat template makes of it."""
        tokenizer = self.require_tokenizer()
        return render_chat_prompt(
            tokenizer,
            body,
            self.chat_template,
            self.args.chat_template_content_format,
            image_placeholder(self.model_config.hf_config),
        )

    # ---- running -------------------------------------------------------------------------

    def request_id(self, raw: web.Request, body: _SamplingRequest, prefix: str) -> str:
        base = raw.headers.get("X-Request-Id") or body.request_id
        return f"{prefix}-{base}" if base else random_id(prefix)

    def log_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        if self.args.disable_log_requests:
            return
        limit = self.args.max_log_len
        text, ids = prompt["prompt"], prompt["prompt_token_ids"]
        if limit is not None:
            text = text[:limit] if text is not None else None
            ids = ids[:limit]
        if "prompt_embeds" in prompt:  # (its ids are placeholders)
            ids = f"none ({len(prompt['prompt_embeds'])} prompt embeddings)"
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id, text, params, ids
        )

    def generate_all(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: list[SamplingParams],
        priority: int,
        beams: list[BeamSearchParams | None] | None = None,
        model: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several prompts as they come, tagged with the prompt's index.

        Every prompt is checked (make_request) before any is queued, so a bad second
        prompt never leaves the first one running. Leaving early aborts them all. With
        `beams` (use_beam_search), each prompt's beam search yields one final output.
        """
        lora = self.loras.get(model)  # a LoRA adapter's name selects it
        if beams is not None and beams[0] is not None:
            searches = [self.engine.start_beam_search(p, b) for p, b in zip(prompts, beams, strict=True)]
            return merge_streams(
                [
                    self._beam_output(
                        request_id if len(prompts) == 1 else f"{request_id}-{i}", p, s, sp, lora
                    )
                    for i, (p, s, sp) in enumerate(zip(prompts, searches, params, strict=True))
                ]
            )
        parents = [
            self.engine.make_request(
                p, sp, request_id if len(prompts) == 1 else f"{request_id}-{i}", priority, lora, trace_headers
            )
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        return merge_streams([self.engine.stream(parent) for parent in parents])

    async def _beam_output(
        self, request_id: str, prompt: Prompt, search: BeamSearch, params: SamplingParams, lora=None
    ) -> AsyncIterator[RequestOutput]:
        """A beam search's result as one finished RequestOutput: the beams as completions,
        best first, with the logprobs the request asked for (the chosen token and its top k)."""
        result = await self.engine.beam_search(search, request_id, lora)
        prompt_len = len(prompt["prompt_token_ids"])
        tokenizer = self.engine.tokenizer
        k = params.logprobs
        completions = []
        for index, seq in enumerate(result.sequences):
            generated = seq.tokens[prompt_len:]
            text = (
                tokenizer.decode(generated, skip_special_tokens=params.skip_special_tokens)
                if tokenizer
                else ""
            )
            logprobs = None
            if k is not None:
                logprobs = [
                    {t: lp for t, lp in entry.items() if t == token or (k == -1 or lp.rank <= k)}
                    for entry, token in zip(seq.logprobs, generated)
                ]
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=generated,
                    cumulative_logprob=seq.cum_logprob,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        yield RequestOutput(
            request_id, prompt["prompt"], prompt["prompt_token_ids"], completions, finished=True
        )

    # ---- answers -------------------------------------------------------------------------

    def as_token_ids(self, body: _SamplingRequest) -> bool:
        """Whether tokens are written `token_id:N` (the request's field, else the server flag)."""
        flag = body.return_tokens_as_token_ids
        return self.args.return_tokens_as_token_ids if flag is None else flag

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": None,
        }
        if self.args.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage
