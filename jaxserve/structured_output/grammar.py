"""Grammars for structured outputs, on llguidance.

llguidance compiles a JSON schema, regex, choice or Lark/GBNF grammar against the tokenizer's
vocabulary and, from a matcher's state, computes the set of tokens that keep the output inside
the grammar as a packed bitmask. It drops the GIL while it compiles and while it fills masks,
and fills the rows of a batch in parallel on its own threads.
"""

from __future__ import annotations

import collections
import copy
import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxserve.config import STRUCTURED_OUTPUT_BACKENDS, StructuredOutputsConfig
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.scheduler_output import SchedulerOutput

# Distinct compiled grammars kept; a hit costs a matcher copy (microseconds) instead of a compile.
_CACHE_SIZE = 256
# Backends other engines offer that need torch: named in the refusal.
_TORCH_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")


def check_backend(backend: str | None, where: str) -> None:
    """A backend name from a flag or a request: ValueError for one jaxserve cannot run."""
    if backend is None:
        return
    name = backend.split(":", 1)[0]  # vLLM's older "xgrammar:disable-any-whitespace" spelling
    if name in ("llguidance",) or name in STRUCTURED_OUTPUT_BACKENDS:
        return
    if name in _TORCH_BACKENDS:
        raise ValueError(
            f"{where} {backend!r} is not available in jaxserve (it needs torch); use 'guidance' (llguidance) or 'auto'."
        )
    raise ValueError(f"{where} {backend!r} is not a structured-outputs backend; use 'guidance' or 'auto'.")


def close_objects(schema: Any, declared_only: bool = False) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say
    (--guided-decoding-disable-additional-properties); with `declared_only`, only on objects
    that list their properties (a free-form `{"type": "object"}` stays free)."""
    if isinstance(schema, list):
        return [close_objects(s, declared_only) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: close_objects(v, declared_only) for k, v in schema.items()}
    listed = "properties" in out or (out.get("type") == "object" and not declared_only)
    if listed and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class RequestGrammar:
    """One sequence's place in its grammar. With a reasoning parser, the grammar starts after the
    reasoning ends (the end-of-thinking token); until then the sequence is unconstrained."""

    def __init__(self, matcher, reasoning_end_id: int | None = None, reasoning_ended: bool = True):
        self.matcher = matcher
        self.reasoning_end_id = reasoning_end_id
        self.reasoning_ended = reasoning_ended

    @property
    def active(self) -> bool:
        """Whether this step's token is constrained (a complete grammar allows only EOS)."""
        return self.reasoning_ended

    @property
    def terminated(self) -> bool:
        """The grammar is complete (or broken): the sequence stops."""
        return self.reasoning_ended and (self.matcher.is_stopped() or self.matcher.is_error())

    def accept(self, token: int) -> None:
        if not self.reasoning_ended:
            self.reasoning_ended = token == self.reasoning_end_id
            return
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)  # a refused token leaves the matcher in error: terminated


class GrammarCompiler:
    """Compiles and caches requests' grammars for one tokenizer and vocabulary."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        config: StructuredOutputsConfig,
        reasoning_parser=None,  # a jaxserve.reasoning parser instance, or None
    ):
        check_backend(config.backend, "structured outputs backend")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.config = config
        self.reasoning_parser = reasoning_parser
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._executor = None
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()

    @property
    def num_cached(self) -> int:
        """Distinct grammars compiled and kept (the most recently used _CACHE_SIZE)."""
        with self._lock:
            return len(self._cache)

    def _llguidance(self):
        """The llguidance tokenizer and mask executor, built on first use (a vocabulary scan of
        tens of milliseconds: no cost to an engine that never sees a constrained request)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                if self.tokenizer is None:
                    raise ValueError("structured outputs need a tokenizer (skip_tokenizer_init is set).")
                backend = getattr(self.tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise ValueError("structured outputs need a fast (tokenizers-based) tokenizer.")
                backend = copy.copy(backend)
                backend.no_padding()
                backend.no_truncation()
                self._ll_tokenizer = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
                self._executor = llguidance.LLExecutor()
            return self._ll_tokenizer, self._executor

    def grammar_text(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of a request's constraint (not yet checked)."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        check_backend(params.backend, "guided_decoding_backend")
        kind, spec = params.kind, params.spec
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else spec
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object.")
            if self.config.disable_additional_properties or params.disable_additional_properties:
                schema = close_objects(schema)
            options: dict[str, Any] = {
                "whitespace_flexible": not (
                    self.config.disable_any_whitespace or params.disable_any_whitespace
                )
            }
            if params.whitespace_pattern is not None:
                options["whitespace_pattern"] = params.whitespace_pattern
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except (TypeError, ValueError) as e:
                raise ValueError(f"the JSON schema cannot be compiled: {e}") from None
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        if kind == "grammar":
            try:
                return LLMatcher.grammar_from_lark(any_to_lark(spec))
            except Exception as e:  # the converter raises bare Exceptions
                raise ValueError(f"the grammar is neither Lark nor GBNF: {e}") from None
        raise ValueError(f"structured outputs {kind} is not supported by jaxserve.")

    def compile(self, params: StructuredOutputsParams):
        """A fresh matcher for the constraint; ValueError naming what is wrong with it. Compiled
        once per distinct constraint (and options), then copied."""
        ll_tokenizer, _ = self._llguidance()
        grammar = self.grammar_text(params)
        with self._lock:
            prototype = self._cache.get(grammar)
            if prototype is not None:
                self._cache.move_to_end(grammar)
                return prototype.deep_copy()
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar, ll_tokenizer)
        if error:
            raise ValueError(f"invalid {params.kind} for structured outputs: {error.strip()}")
        prototype = LLMatcher(ll_tokenizer, grammar, log_level=0)
        if prototype.is_error():
            raise ValueError(f"invalid {params.kind} for structured outputs: {prototype.get_error()}")
        with self._lock:
            self._cache[grammar] = prototype
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return prototype.deep_copy()

    def request_grammar(
        self, matcher, prompt_token_ids: Sequence[int], accepted: Sequence[int] = ()
    ) -> RequestGrammar:
        """A sequence's state in a matcher from compile(): with a reasoning parser, the grammar
        waits for the reasoning to end unless the prompt already ended it. `accepted`: output the
        grammar has taken already (a beam's tokens so far); ValueError if it does not fit."""
        parser = self.reasoning_parser
        if parser is None:
            state = RequestGrammar(matcher)
        else:
            ended = parser.end_token_id is None or parser.is_reasoning_end(prompt_token_ids)
            state = RequestGrammar(matcher, parser.end_token_id, ended)
        for token in accepted:
            state.accept(token)
        if matcher.is_error():
            raise ValueError(
                f"the tokens given as accepted output do not fit the grammar: {matcher.get_error()}"
            )
        return state

    def fill(self, rows: list[tuple[Any, int]], bitmask: np.ndarray) -> None:
        """Write each (matcher, row)'s allowed tokens into its row of `bitmask`, in parallel."""
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        if len(rows) == 1:
            fill_next_token_bitmask(rows[0][0], bitmask, rows[0][1])
        else:
            fill_next_token_bitmask_par(self._llguidance()[1], rows, bitmask)


def bitmask_filler(
    compiler: GrammarCompiler | None, sched: SchedulerOutput, requests: Mapping[str, Any]
) -> Callable[[np.ndarray], None] | None:
    """What fills this step's token mask ([rows, words] int32, preset to all-allowed), or None
    when no row of the step is constrained (the step then needs no mask)."""
    rows = [
        (requests[s.request_id].grammar.matcher, i)
        for i, s in enumerate(sched.seqs)
        if s.sampling is not None and s.sampling.constrained
    ]
    if not rows or compiler is None:
        return None
    return lambda bitmask: compiler.fill(rows, bitmask)
