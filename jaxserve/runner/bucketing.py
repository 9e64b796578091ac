"""The only place step shapes are chosen.

A step is padded to a (num_tokens, num_seqs) bucket. Every bucket is compiled once at
start-up, so a running server never compiles; fewer buckets mean a faster start, more
buckets mean less padding. Token buckets are powers of two, from the compilation config's
min_token_bucket up to max_num_batched_tokens. On CPU the smallest is 1: XLA:CPU multiplies
a single row by the weights about four times faster than 16 rows, so a lone decode must
not be padded to 16; accelerators process 16 rows as fast as one, and start at 16.
By default each token bucket T has one sequence bucket, min(T, max_num_seqs): the rows
padded that way cost only the LM head and the sampler, a few percent of a step, while a
second sequence dimension would multiply start-up compilation. The compilation config
can name both lists, and then every (T, S) pair with S <= T is compiled.

Start-up compiles two token buckets before the engine serves: the smallest (decodes) and the
one that takes a typical chat prompt in one step (FIRST_PREFILL_TOKENS). The others compile
in the background, smallest first; until a bucket is ready the scheduler's token budget stays
at the largest ready one, so a step never waits for a compile, and a long prompt is prefilled
in smaller chunks meanwhile.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from jaxserve.config import CompilationConfig, SchedulerConfig

FIRST_PREFILL_TOKENS = 128


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return out


@dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]  # ascending
    seqs: tuple[int, ...]  # ascending

    @classmethod
    def from_config(cls, sched: SchedulerConfig, comp: CompilationConfig) -> Buckets:
        max_tokens, max_seqs = sched.max_num_batched_tokens, sched.max_num_seqs
        tokens = comp.token_buckets or _powers_of_two(min(comp.min_token_bucket, max_tokens), max_tokens)
        tokens = sorted(set(tokens))
        seqs = sorted(set(comp.seq_buckets or {min(t, max_seqs) for t in tokens}))
        if tokens[-1] < max_tokens or seqs[-1] < max_seqs:
            raise ValueError(
                f"compilation_config buckets must reach max_num_batched_tokens={max_tokens} and "
                f"max_num_seqs={max_seqs}; got tokens {tokens}, seqs {seqs}."
            )
        return cls(tuple(tokens), tuple(seqs), coupled=not comp.seq_buckets)

    coupled: bool = True  # one sequence bucket per token bucket

    def pick(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        t = self.tokens[bisect.bisect_left(self.tokens, num_tokens)]
        if self.coupled:
            return t, min(t, self.seqs[-1])
        s = self.seqs[bisect.bisect_left(self.seqs, num_seqs)]
        return t, min(s, t)

    def all(self) -> list[tuple[int, int]]:
        if self.coupled:
            return [(t, min(t, self.seqs[-1])) for t in self.tokens]
        return sorted({(t, min(s, t)) for t in self.tokens for s in self.seqs})

    def of_tokens(self, token_bucket: int) -> list[tuple[int, int]]:
        """The (T, S) buckets of one token bucket T."""
        return [bucket for bucket in self.all() if bucket[0] == token_bucket]

    def startup_order(self) -> tuple[list[int], list[int]]:
        """(token buckets to compile before serving, the rest in the order to compile them)."""
        prefill = next((t for t in self.tokens if t >= FIRST_PREFILL_TOKENS), self.tokens[-1])
        first = sorted({self.tokens[0], prefill})
        return first, [t for t in self.tokens if t not in first]

    def subset(self, token_buckets) -> Buckets:
        """These buckets restricted to some of their token buckets (the ones compiled so far)."""
        return Buckets(tuple(sorted(token_buckets)), self.seqs, coupled=self.coupled)
