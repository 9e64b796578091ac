"""Beam search, as transformers' `generate(num_beams=...)` defines it, driven over the engine.

Each step runs every live beam as a one-token request asking for its top 2 * beam_width
logprobs; the beams' tokens so far are the prompt, so their common prefix comes from the
prefix cache (beams share pages; only a beam's last partial page is computed again).
BeamSearch holds one prompt's search and knows nothing of the engine; LLM.beam_search and
the server drive it.

The rules (transformers' defaults, early_stopping=False):
- candidates: the 2 * beam_width best continuations of all beams by cumulative logprob;
- a candidate among the best beam_width that ends in EOS, or reaches max_tokens, finishes
  with score cumulative_logprob / generated_length ** length_penalty (EOS counted); the
  beam_width best finished ones are kept;
- the best beam_width candidates that do not finish run on;
- the search ends at max_tokens, or once beam_width beams have finished and the best
  running beam, scored at its current length, cannot beat the worst of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.outputs import Logprob
from jaxserve.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # Every beam held to this constraint: each step's mask allows only the tokens its grammar does.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature!r}.")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt and generated tokens
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # one per generated token
    cum_logprob: float = 0.0
    score: float = 0.0  # cum_logprob / generated_length ** length_penalty
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


class BeamSearch:
    """One prompt's beam search. `running` are the beams to extend next; `advance` takes,
    for each of them, its next-token logprobs (at least the 2 * beam_width best)."""

    def __init__(
        self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_id: int | None, max_tokens: int
    ):
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        self.eos = None if params.ignore_eos else eos_token_id
        self.max_tokens = max_tokens
        self.running = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.done = False

    def _score(self, cum_logprob: float, generated: int) -> float:
        return cum_logprob / generated**self.params.length_penalty

    def advance(self, next_logprobs: list[dict[int, Logprob]]) -> None:
        width = self.params.beam_width
        generated = len(self.running[0].tokens) - self.prompt_len + 1  # with the token chosen now
        candidates = sorted(
            (
                (beam.cum_logprob + lp.logprob, -b, -rank, beam, token, entry)
                for b, (beam, entry) in enumerate(zip(self.running, next_logprobs, strict=True))
                for rank, (token, lp) in enumerate(sorted(entry.items(), key=lambda kv: -kv[1].logprob))
                if lp.logprob > float("-inf")  # a token a constraint masked is no candidate
            ),
            key=lambda c: c[:3],
            reverse=True,
        )[: 2 * width]
        at_limit = generated >= self.max_tokens
        running = []
        for i, (cum, _, _, beam, token, entry) in enumerate(candidates):
            seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry], cum)
            if token == self.eos or at_limit:
                if i < width:  # only the best beam_width candidates may finish
                    seq.score = self._score(cum, generated)
                    seq.finish_reason = "length" if token != self.eos else "stop"
                    self.finished.append(seq)
            elif len(running) < width:
                running.append(seq)
        self.finished = sorted(self.finished, key=lambda s: -s.score)[:width]
        self.running = running
        best_possible = self._score(running[0].cum_logprob, generated) if running else float("-inf")
        full = len(self.finished) == width
        self.done = at_limit or not running or (full and best_possible <= self.finished[-1].score)

    def result(self) -> BeamSearchOutput:
        return BeamSearchOutput(sorted(self.finished, key=lambda s: -s.score))


def start_search(engine, prompt_token_ids: list[int], params: BeamSearchParams) -> BeamSearch:
    """A search for one prompt on `engine` (an LLMEngine); ValueError if it cannot run."""
    limit = engine.config.model_config.max_logprobs
    if limit != -1 and 2 * params.beam_width > limit:
        raise ValueError(
            f"beam_width {params.beam_width} needs the top {2 * params.beam_width} logprobs per step; "
            f"--max-logprobs is {limit}."
        )
    room = engine.config.model_config.room_after(len(prompt_token_ids))
    return BeamSearch(prompt_token_ids, params, engine.eos_token_id, min(params.max_tokens, room))


def step_params(params: BeamSearchParams):
    """The one-token request each beam makes per step."""
    from jaxserve.sampling_params import SamplingParams

    return SamplingParams(
        temperature=params.temperature,
        max_tokens=1,
        ignore_eos=True,
        logprobs=2 * params.beam_width,
        detokenize=False,
        structured_outputs=params.structured_outputs,
    )


def step_prompt(search: BeamSearch, beam: BeamSearchSequence) -> dict:
    """A beam's one-token request: its tokens are the prompt; under a constraint, those after the
    search's prompt are output the grammar has already accepted (`structured_output_start`)."""
    prompt = {"prompt_token_ids": beam.tokens}
    if search.params.structured_outputs is not None:
        prompt["structured_output_start"] = search.prompt_len
    return prompt


def finish(search: BeamSearch, tokenizer) -> BeamSearchOutput:
    out = search.result()
    if tokenizer is not None:
        for seq in out.sequences:
            seq.text = tokenizer.decode(seq.tokens)
    return out
