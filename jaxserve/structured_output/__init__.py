"""Structured outputs: constraining what a request generates to a JSON schema, a regex, a choice
or a grammar.

Where it sits: beside the engine. The InputProcessor asks `GrammarCompiler` for a request's
grammar (compiled once per distinct spec by llguidance, cached, and checked there: a bad schema
is a ValueError before anything is queued); each sequence carries a `RequestGrammar` that the
Scheduler advances with every sampled token. Each step, `bitmask_filler` gives the runner a
function that writes the packed token mask ([rows, ceil(vocab / 32)] int32, bit set = allowed)
of the constrained rows; the runner calls it while the device runs the forward pass and the
step applies the mask before sampling, so every sampler feature works under a constraint.
"""

from jaxserve.structured_output.grammar import GrammarCompiler, RequestGrammar, bitmask_filler

__all__ = ["GrammarCompiler", "RequestGrammar", "bitmask_filler"]
