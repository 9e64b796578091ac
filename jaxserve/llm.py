"""The offline API, as in vLLM: `LLM(model=...).generate(prompts, sampling_params)`,
`LLM.chat(messages)` and `LLM.beam_search(prompts, BeamSearchParams(...))`. It drives an
LLMEngine to completion and returns outputs in input order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxserve import beam_search as beam
from jaxserve.args import EngineArgs
from jaxserve.engine.input_processor import PromptType
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import PoolingRequestOutput, RequestOutput, ScoringOutput
from jaxserve.pooling_params import (
    POOLING_TASKS,
    PoolingParams,
    cosine,
    is_cross_encoder,
    pair_prompt,
    score_pairs,
)
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        known = EngineArgs.field_names()
        extra = {k: v for k, v in kwargs.items() if k not in known}
        args = EngineArgs(model=model, **{k: v for k, v in kwargs.items() if k in known}, extra=extra)
        if args.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 runs replicas behind one server (`jaxserve serve -dp N`); "
                "the offline LLM runs a single engine."
            )
        self.llm_engine = LLMEngine.from_engine_args(args)
        # A batch job runs at full speed from its first step: every bucket before returning
        # (the server instead starts answering while the larger ones compile).
        self.llm_engine.runner.wait_compiled()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overlaid with the model's generation config (--generation-config)."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request: the adapter every prompt is served with, or one per prompt (None: the
        base model); needs enable_lora."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        # only the final outputs are read here: the engine builds no output before a request ends
        final_only = {id(p): p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in sampling_params}
        sampling_params = [final_only[id(p)] for p in sampling_params]
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"Got {len(sampling_params)} sampling_params for {len(prompts)} prompts; pass one or one each."
            )
        return self._run(prompts, sampling_params, use_tqdm, priority, lora_request)

    def embed(self, prompts, pooling_params=None, **kwargs) -> list[PoolingRequestOutput]:
        """vLLM's LLM.embed: an embedding per prompt (`outputs.embedding`, a list of floats), from
        an embedding model. Keywords as encode's (truncate_prompt_tokens, use_tqdm, lora_request)."""
        return [
            o.as_embedding() for o in self.encode(prompts, pooling_params, pooling_task="embed", **kwargs)
        ]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str = "encode",
    ) -> list[PoolingRequestOutput]:
        """vLLM's LLM.encode: each prompt's pooled vector (`outputs.data`, a float32 array)."""
        prompts = _prompt_list(prompts)
        if pooling_task not in POOLING_TASKS:
            raise ValueError(
                f"pooling_task {pooling_task!r} is not supported; supported: {list(POOLING_TASKS)}."
            )
        if self.llm_engine.config.model_config.runner_type != "pooling":
            raise ValueError(
                f"LLM.{pooling_task if pooling_task in ('embed', 'classify', 'reward') else 'encode'} needs a pooling "
                "model (--runner pooling); this one is served for generation."
            )
        if pooling_params is None:
            pooling_params = PoolingParams()
        if isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params] * len(prompts)
        if truncate_prompt_tokens is not None:
            pooling_params = [p.clone(truncate_prompt_tokens=truncate_prompt_tokens) for p in pooling_params]
        pooling_params = [p.clone(task=pooling_task) for p in pooling_params]
        return self._run(prompts, pooling_params, use_tqdm, None, lora_request)

    def classify(self, prompts, pooling_params=None, **kwargs) -> list[PoolingRequestOutput]:
        """vLLM's LLM.classify: each prompt's class probabilities (`outputs.probs`), from a sequence
        classifier (a *ForSequenceClassification checkpoint). Keywords as encode's."""
        outs = self.encode(prompts, pooling_params, pooling_task="classify", **kwargs)
        return [o.as_classification() for o in outs]

    def reward(self, prompts, pooling_params=None, **kwargs) -> list[PoolingRequestOutput]:
        """vLLM's LLM.reward: a reward model's rows for each prompt (`outputs.data`, [rows, labels]):
        one per token (ALL) or per step tag (STEP). Keywords as encode's."""
        return self.encode(prompts, pooling_params, pooling_task="reward", **kwargs)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's LLM.score: how alike each pair of texts is (`outputs.score`), data_1 one text
        against each of data_2, or pairwise. An embedding model: the cosine similarity of their
        embeddings; a cross-encoder (a classifier of one label): its probability for the pair."""
        pairs = score_pairs(data_1, data_2)
        kw = dict(truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm, lora_request=lora_request)
        if is_cross_encoder(self.llm_engine.config.model_config.pooler_config):
            prompts = [pair_prompt(self.get_tokenizer(), a, b) for a, b in pairs]
            outs = self.encode(prompts, pooling_task="score", **kw)
            scores = [float(out.outputs.data[0]) for out in outs]
            token_ids = [out.prompt_token_ids for out in outs]
        else:
            distinct = list(dict.fromkeys(t for pair in pairs for t in pair))
            by_text = dict(zip(distinct, self.encode(distinct, pooling_task="embed", **kw)))
            scores = [cosine(by_text[a].outputs.data, by_text[b].outputs.data) for a, b in pairs]
            token_ids = [by_text[a].prompt_token_ids + by_text[b].prompt_token_ids for a, b in pairs]
        return [
            PoolingRequestOutput(str(i), ScoringOutput(score), ids, finished=True)
            for i, (score, ids) in enumerate(zip(scores, token_ids))
        ]

    def _run(self, prompts: list, params: list, use_tqdm: bool, priority, lora_request) -> list:
        """Add every prompt with its params (all or none: a refused one aborts those added), then
        step the engine until all have finished; their final outputs in prompt order."""
        if len(params) != len(prompts):
            raise ValueError(f"Got {len(params)} params for {len(prompts)} prompts; pass one or one each.")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"Got {len(priority)} priorities for {len(prompts)} prompts.")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"Got {len(loras)} lora_requests for {len(prompts)} prompts.")
        engine = self.llm_engine
        if engine.is_sleeping:
            raise RuntimeError("The engine is asleep (LLM.sleep); call LLM.wake_up() before generating.")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = engine.new_request_id()
                engine.add_request(
                    rid, prompt, p, priority=priority[i] if priority else 0, lora_request=loras[i]
                )
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def sleep(self, level: int = 1) -> None:
        """Free the weights and KV cache on the devices (needs enable_sleep_mode=True), for
        another user of the accelerator; wake_up() takes them back. Level 1 keeps the weights in
        host memory; level 2 does not (waking reads the checkpoint again). The prefix cache is
        emptied."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take back what sleep() freed: everything, or the parts named ("weights", "kv_cache")."""
        self.llm_engine.wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes; False if requests are running (nothing is reset then)."""
        return self.llm_engine.reset_prefix_cache()

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: beam.BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[beam.BeamSearchOutput]:
        """Beam search over each prompt (see jaxserve/beam_search.py), with the LoRA adapter if
        given; all prompts' beams run together, one token per engine round."""
        prompts = _prompt_list(prompts)
        engine = self.llm_engine
        searches = [beam.start_search(engine, engine.tokenize_prompt(p)[1], params) for p in prompts]
        step = beam.step_params(params)
        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm)
        while live := [s for s in searches if not s.done]:
            beams = [beam.step_prompt(s, b) for s in live for b in s.running]
            outs = iter(self.generate(beams, step, use_tqdm=False, lora_request=lora_request))
            for s in live:
                s.advance([next(outs).outputs[0].logprobs[0] for _ in s.running])
            bar.update(1)
        bar.close()
        return [beam.finish(s, engine.tokenizer) for s in searches]

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation through the chat template (with `tools` for the
        template to show the model), then generate. Images come as content parts: OpenAI's
        `image_url` (data:, file:// under --allowed-local-media-path, http(s)) or vLLM's
        `image_pil` ({"type": "image_pil", "image_pil": a PIL image})."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat() needs a tokenizer (skip_tokenizer_init is set).")
        from jaxserve.multimodal.chat import load_images, split_images  # (Pillow: only for chat)
        from jaxserve.multimodal.media import MediaLimits

        prompts = []
        for conversation in conversations:
            conversation, images = split_images(conversation)
            ids = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tokenize=True,
                **({"tools": tools} if tools else {}),
                **(chat_template_kwargs or {}),
            )
            if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            prompt = {"prompt_token_ids": list(ids)}
            if images:
                limits = MediaLimits(self.llm_engine.config.model_config.allowed_local_media_path)
                prompt["multi_modal_data"] = {"image": load_images(images, limits)}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _prompt_list(prompts) -> list:
    """One prompt (text, token ids or a dict) or several, as a list."""
    if isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)
