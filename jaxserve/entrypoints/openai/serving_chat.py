"""POST /v1/chat/completions: messages through the chat template, JSON or SSE.

The answer's role is --response-role (when a generation prompt is added). With `echo`,
the content of the last message is repeated first when it has that role, as in vLLM.
With `logprobs`, each choice (each chunk, streaming) carries the logprobs of its tokens
in OpenAI's `{"content": [...]}` shape; `prompt_logprobs` (vLLM's field) is top-level.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import NamedTuple

from aiohttp import web

from jaxserve.engine.tracing import trace_headers
from jaxserve.entrypoints.openai.chat_prompt import chat_image_urls
from jaxserve.entrypoints.openai.chat_reply import ChatReply
from jaxserve.entrypoints.openai.chat_tools import reply_tool_parser, tool_choice_mode, tool_constraint
from jaxserve.entrypoints.openai.logprobs import prompt_logprobs
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, bad_request, now
from jaxserve.entrypoints.openai.serving_engine import OpenAIServing, Prompt
from jaxserve.entrypoints.openai.sse import sse_response
from jaxserve.entrypoints.openai.structured_outputs import structured_outputs_field, structured_outputs_params
from jaxserve.multimodal.images import DEFAULT_LIMIT
from jaxserve.multimodal.media import MediaLimits, load_image
from jaxserve.outputs import RequestOutput
from jaxserve.reasoning import get_reasoning_parser


class ChatRun(NamedTuple):
    """A queued chat request: its id, the model name it answers as, its prompt's length, its
    outputs as they come (tagged with the prompt's index, 0) and what shapes its reply."""

    request_id: str
    model: str
    prompt_tokens: int
    outputs: AsyncIterator[tuple[int, RequestOutput]]
    reply: ChatReply


async def last_output(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> RequestOutput:
    final: RequestOutput | None = None
    async with contextlib.aclosing(outputs) as gen:
        async for _, out in gen:
            final = out
    return final


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine, args, loras=None):
        super().__init__(engine, args, loras)
        name = engine.config.structured_outputs_config.reasoning_parser
        self.reasoning_parser = get_reasoning_parser(name)(self.tokenizer) if name else None
        self.auto_tool_parser = args.tool_call_parser if args.enable_auto_tool_choice else None

    def role(self, body: ChatCompletionRequest) -> str:
        return self.args.response_role if body.add_generation_prompt else body.messages[-1].role

    async def prompt_for(self, body: ChatCompletionRequest) -> Prompt:
        """Render and tokenize the conversation, and fetch, decode and process its images, with
        their placeholders expanded (off the event loop: templates, long conversations and
        images take a while)."""

        def render() -> Prompt:
            text = self.render_chat(body)
            return self.tokenize(text, body.add_special_tokens, body.truncate_prompt_tokens)

        prompt = await asyncio.to_thread(render)
        urls = chat_image_urls(body)
        if not urls:
            return prompt
        limit = self.model_config.limit_mm_per_prompt.get("image", DEFAULT_LIMIT)
        if len(urls) > limit:
            raise ValueError(
                f"At most {limit} image(s) may be provided in one prompt (--limit-mm-per-prompt); got {len(urls)}."
            )
        limits = MediaLimits(allowed_local_media_path=self.model_config.allowed_local_media_path)
        images = await asyncio.gather(*(load_image(url, limits) for url in urls))
        prompt["multi_modal_data"] = {"image": images}
        return await asyncio.to_thread(self.engine.expand_images, prompt)

    async def create(self, body: ChatCompletionRequest, raw: web.Request) -> web.StreamResponse:
        run = await self.start(body, raw, "chatcmpl")
        request_id, model, prompt_tokens, outputs, reply = run
        head = {"id": request_id, "object": "chat.completion", "created": now(), "model": model}
        role = self.role(body)
        echo = self._echo_text(body, role)
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return await sse_response(
                raw, self._chunks(body, head, role, echo, prompt_tokens, outputs, reply)
            )
        final = await last_output(outputs)
        choices = []
        for c in final.outputs:
            fields, finish_reason = reply.message(c.text, c.finish_reason)
            if echo:
                fields["content"] = echo + (fields["content"] or "")
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": role, **fields},
                    "logprobs": self._logprobs(body, c.token_ids, c.logprobs),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        usage = self.usage(prompt_tokens, completion_tokens, final.num_cached_tokens)
        return web.json_response(
            {**head, "choices": choices, "usage": usage, "prompt_logprobs": prompt_logprobs(final)}
        )

    async def start(self, body: ChatCompletionRequest, raw: web.Request, id_prefix: str) -> ChatRun:
        """Check the request, render and tokenize its conversation and queue it: everything but
        shaping the answer (also the Responses API's way in)."""
        model = self.model_name(body.model)
        body.check_stream_options()
        body.check_logprobs()
        body.check_messages()
        mode, function = tool_choice_mode(body, self.auto_tool_parser)
        tools = reply_tool_parser(
            mode, function, self.args.tool_call_parser, self.tokenizer, body.parallel_tool_calls is not False
        )
        field = "tool_choice" if mode in ("named", "required") else structured_outputs_field(body)
        if mode in ("named", "required") and structured_outputs_field(body) is not None:
            raise bad_request("tool_choice 'required' or a named function cannot be combined with another "
                              "structured-output constraint.", "tool_choice")  # fmt: skip
        constraint = tool_constraint(body, mode, function) or structured_outputs_params(body)
        await self.check_structured_outputs(constraint, field)
        prompt = await self.prompt_for(body)
        prompt_tokens = len(prompt["prompt_token_ids"])
        params = body.to_sampling_params(
            self.max_tokens(body.requested_max_tokens, prompt_tokens), self.sampling_defaults, constraint
        )
        if tools is not None and tools.keeps_special_tokens:  # its markers are special tokens
            params.skip_special_tokens = False
        reply = self._reply(body, prompt, tools, mode == "named")
        request_id = self.request_id(raw, body, id_prefix)
        self.log_request(request_id, prompt, params)
        beams = [body.to_beam_search_params(params.max_tokens, constraint)]
        outputs = self.generate_all(
            request_id, [prompt], [params], body.priority, beams, model, trace_headers(raw.headers)
        )
        return ChatRun(request_id, model, prompt_tokens, outputs, reply)

    def _reply(self, body: ChatCompletionRequest, prompt: Prompt, tools, forced_function: bool) -> ChatReply:
        ended = False
        if self.reasoning_parser is not None:
            thinking_off = (body.chat_template_kwargs or {}).get("enable_thinking") is False
            ended = thinking_off or self.reasoning_parser.is_reasoning_end(prompt["prompt_token_ids"])
        return ChatReply(self.reasoning_parser, ended, tools, forced_function)

    def _logprobs(self, body: ChatCompletionRequest, token_ids, entries) -> dict | None:
        if not body.logprobs:
            return None
        return self.logprob_formatter.chat_logprobs(
            token_ids, entries or [], body.top_logprobs or 0, self.as_token_ids(body)
        )

    @staticmethod
    def _echo_text(body: ChatCompletionRequest, role: str) -> str:
        last = body.messages[-1]
        if not body.echo or last.role != role or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "".join(p.get("text", "") for p in last.content)

    async def _chunks(self, body, head, role, echo, prompt_tokens, outputs, reply) -> AsyncIterator[dict]:
        def chunk(index: int, delta: dict, finish_reason=None, stop_reason=None, logprobs=None) -> dict:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = stop_reason
            return {**head, "choices": [choice]}

        for i in range(body.n):  # the role first, as OpenAI does
            yield chunk(i, {"role": role, "content": ""})
            if echo:
                yield chunk(i, {"content": echo})
        streams = [reply.stream() for _ in range(body.n)]
        tokens = [0] * body.n
        done: set[int] = set()
        cached = 0
        async with contextlib.aclosing(outputs) as gen:
            async for _, out in gen:
                for c in out.outputs:
                    if c.index in done:  # a finished sample still shows in its siblings' outputs
                        continue
                    if c.finish_reason is not None:
                        done.add(c.index)
                    stream = streams[c.index]  # c holds what is new since its last output (DELTA)
                    delta = stream.update(c.text, c.finish_reason is not None)
                    tokens[c.index] += len(c.token_ids)
                    new_tokens = body.logprobs and c.token_ids
                    if not delta and not new_tokens and c.finish_reason is None:
                        continue
                    logprobs = self._logprobs(body, c.token_ids, c.logprobs)
                    finish_reason = reply.finish_reason(c.finish_reason, stream.called)
                    item = chunk(c.index, delta, finish_reason, c.stop_reason, logprobs)
                    if body.continuous_usage:
                        item["usage"] = self.usage(prompt_tokens, sum(tokens), cached)
                    yield item
                cached = out.num_cached_tokens
        if body.include_usage:
            yield {**head, "choices": [], "usage": self.usage(prompt_tokens, sum(tokens), cached)}
