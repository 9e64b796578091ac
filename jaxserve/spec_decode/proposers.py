"""Draft-token proposers for speculative decoding, run on the host once per decode step.

A proposer guesses the tokens that follow a request's text from text already seen; the step then
feeds the guesses after the request's last token and keeps those its own sampling agrees with.
Both proposers here are pure Python and numpy and keep per-request state that grows with the
request, so a step costs little more than the tokens appended since the previous one.

- NgramProposer: prompt lookup (vLLM's "ngram" method), matching within the request's own text.
- SuffixProposer: suffix decoding (vLLM's "suffix" method), matching within the request's own text
  and the outputs of recently finished requests.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from jaxserve.config import SpeculativeConfig


class Proposer(Protocol):
    """What the scheduler calls: propose once per step for each request that decodes, or, for a
    proposer that `needs_pages` (a draft model's), propose_many once per step for all of them,
    after giving each the pages of its proposals; finish for both."""

    needs_pages: bool

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        """Up to k draft tokens to follow token_ids (the request's prompt followed by its outputs
        so far). [] when it has none."""
        ...

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request ended (finished, aborted or failed): forget its per-request state; a
        proposer that learns from past outputs keeps the outputs."""
        ...

    def propose_many(
        self, rows: Sequence[tuple[str, Sequence[int], Sequence[int], int]]
    ) -> dict[str, list[int]]:
        """needs_pages only: up to k proposals for each (request id, its token ids, its page table,
        k), whose pages hold k - 1 positions past its tokens."""
        ...


# ---------------------------------------------------------------------------------------------
# ngram: prompt lookup


class _TokenBuffer:
    """An np.int32 copy of one request's token ids, grown in place as tokens are appended.

    A request's tokens only grow between calls, so each call copies just the new ones. A list
    shorter than the copy, or one whose last copied token differs, is copied again from the start.
    """

    __slots__ = ("array", "size")

    def __init__(self) -> None:
        self.array = np.empty(256, np.int32)
        self.size = 0

    def sync(self, token_ids: Sequence[int]) -> np.ndarray:
        """Brings the copy up to date with token_ids and returns a view of it."""
        n = len(token_ids)
        if n < self.size or (self.size and token_ids[self.size - 1] != self.array[self.size - 1]):
            self.size = 0
        if n > self.array.shape[0]:
            grown = np.empty(max(n, 2 * self.array.shape[0]), np.int32)
            grown[: self.size] = self.array[: self.size]
            self.array = grown
        if n > self.size:
            self.array[self.size : n] = token_ids[self.size : n]
            self.size = n
        return self.array[:n]


def longest_ngram_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The up to k tokens that followed the most recent earlier occurrence of the longest suffix
    of tokens of min_n..max_n tokens; [] when no suffix of min_n tokens occurs earlier.

    The candidates are the earlier positions that end like the text; each round keeps those whose
    occurrence also agrees one token further back, until none is left or max_n tokens agree.
    Cost: one vectorized pass over the text, then at most max_n passes over the candidates.
    """
    length = tokens.shape[0]
    if k <= 0 or length <= min_n:
        return []
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    matched = 1
    while matched < max_n and ends.size:
        roomy = ends[np.searchsorted(ends, matched) :]  # those with a token further back
        agreeing = roomy[tokens[roomy - matched] == tokens[length - 1 - matched]]
        if agreeing.size == 0:
            break
        ends = agreeing
        matched += 1
    if ends.size == 0 or matched < min_n:
        return []
    start = int(ends[-1]) + 1  # flatnonzero is ascending: the last end is the most recent
    return tokens[start : start + k].tolist()


class NgramProposer:
    """Prompt lookup decoding (vLLM's "ngram" method, prompt_lookup_min/prompt_lookup_max).

    Finds the longest n in [min_n, max_n] such that the last n tokens of the request's text
    (prompt and outputs) occur earlier in it, and proposes the up to k tokens that followed that
    earlier occurrence. Among several earlier occurrences of that n-gram the most recent one wins:
    a request that edits or repeats text it has just seen continues like the latest copy.

    Each request keeps an np.int32 copy of its tokens that grows by the tokens appended between
    calls; finish() drops it. A call costs O(new tokens + text length / SIMD width + max_n x
    candidates), with the text scanned by numpy.
    """

    needs_pages = False  # proposes on the host, from tokens alone

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._buffers: dict[str, _TokenBuffer] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        buffer = self._buffers.get(request_id)
        if buffer is None:
            buffer = self._buffers[request_id] = _TokenBuffer()
        return longest_ngram_continuation(buffer.sync(token_ids), self.min_n, self.max_n, k)

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._buffers.pop(request_id, None)


# ---------------------------------------------------------------------------------------------
# suffix decoding


class _Node:
    """A trie node: count is how many times the token string on its path occurs in the texts.

    An explicit node (text is None) keeps its children by the token that follows, and top, a
    bound on their largest count (exact while counts only grow; removals leave it above). A node
    counted once is usually implicit instead: its subtree is then the single chain of tokens that
    follows its one occurrence, text[pos : min(len(text), stop)], each counted once; for a text
    that is still growing the chain grows with it, at no cost.
    """

    __slots__ = ("count", "children", "top", "text", "pos", "stop")

    def __init__(self, text: list[int] | None = None, pos: int = 0, stop: int = 0) -> None:
        self.count = 0 if text is None else 1
        self.children: dict[int, _Node] = {}
        self.top = 0
        self.text = text
        self.pos = pos
        self.stop = stop

    def split(self) -> None:
        """Makes an implicit node explicit: the first token of its chain becomes an implicit child."""
        text = self.text
        assert text is not None
        if self.pos < min(len(text), self.stop):
            self.children[text[self.pos]] = _Node(text, self.pos + 1, self.stop)
            self.top = 1
        self.text = None


# A place in a SuffixTrie: an explicit node (None) or the text position of the next token along an
# implicit node's chain.
Cursor = tuple[_Node, "int | None"]


class SuffixTrie:
    """Counts every run of up to max_depth consecutive tokens in a set of texts.

    The path from the root to a node spells a token string S of at most max_depth tokens; its
    count is the number of places S occurs in the texts, and the tokens that follow those places
    lead to its children (a child's count never exceeds its parent's). A string that occurs once
    is kept as a position in its text (an implicit _Node) rather than a chain of nodes, so a text
    of L tokens costs O(L) nodes unless it repeats itself; counting it walks, for each of its
    positions, the tokens shared with earlier text, at most max_depth.

    The texts are held by reference and must not change, except by appending to a text (see
    _RequestSuffixes).
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()

    def count_run(self, text: list[int], start: int, node: _Node, depth: int) -> tuple[_Node, int]:
        """Counts the run text[start : start + max_depth] from its token at depth on, as far as
        text goes; node is the explicit node of its first depth tokens, counted already. Returns
        where the run ends and its depth: an implicit node when the rest of the run is that node's
        chain (which grows with text), else the explicit node of the whole run so far."""
        end = min(len(text), start + self.max_depth)
        while start + depth < end:
            token = text[start + depth]
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(text, start + depth + 1, start + self.max_depth)
                node.top = max(node.top, 1)
                return child, depth + 1
            if child.text is not None:
                child.split()  # another run's chain: this run shares its first token
            child.count += 1
            node.top = max(node.top, child.count)
            node, depth = child, depth + 1
        return node, depth

    def add(self, text: list[int]) -> None:
        """Counts the runs of a whole text."""
        for start in range(len(text)):
            self.count_run(text, start, self.root, 0)

    def remove(self, text: list[int]) -> None:
        """Uncounts the runs of a text added before, dropping the nodes no text reaches."""
        for start in range(len(text)):
            node = self.root
            for token in text[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]  # its whole subtree counted only this run
                    break
                node = child

    def find(self, tokens: Sequence[int]) -> Cursor | None:
        """Where the token string tokens ends, or None when it does not occur."""
        cursor: Cursor | None = (self.root, None)
        for token in tokens:
            cursor = self.step(cursor, token)
            if cursor is None:
                return None
        return cursor

    @staticmethod
    def step(cursor: Cursor, token: int) -> Cursor | None:
        """The place one token further, or None when token never follows."""
        node, pos = cursor
        if pos is None:
            child = node.children.get(token)
            if child is None:
                return None
            return child, (None if child.text is None else child.pos)
        assert node.text is not None
        if pos < min(len(node.text), node.stop) and node.text[pos] == token:
            return node, pos + 1
        return None

    @staticmethod
    def followers(cursor: Cursor) -> list[tuple[int, int]]:
        """The tokens that follow the string at cursor, each with the count of the longer string."""
        node, pos = cursor
        if pos is None:
            return [(token, child.count) for token, child in node.children.items()]
        assert node.text is not None
        return [(node.text[pos], 1)] if pos < min(len(node.text), node.stop) else []

    @staticmethod
    def top_bound(cursor: Cursor) -> int:
        """A bound on the largest count among the followers of the string at cursor."""
        node, pos = cursor
        if pos is None:
            return node.top if node.children else 0
        return int(SuffixTrie.has_followers(cursor))

    @staticmethod
    def has_followers(cursor: Cursor) -> bool:
        node, pos = cursor
        if pos is None:
            return bool(node.children)
        assert node.text is not None
        return pos < min(len(node.text), node.stop)


class _RequestSuffixes:
    """The SuffixTrie of one request's prompt and outputs, counting the tokens appended between
    calls. A list shorter than the tokens seen, or one whose last seen token differs, is counted
    again from the start.

    The runs of the last max_depth - 1 tokens are not complete yet. Those that end at an explicit
    node are kept in open_runs, to count the next tokens from. One whose rest is an implicit node's
    chain is done: the chain grows with the text, and no other run empties it. Each call appends
    all its tokens before counting runs in order of start, so a run that enters the chain of run A
    started after A (an earlier run still open ends at an explicit node, above A's chain) and,
    ending at the text's end, stops short of the end of A's chain.
    """

    __slots__ = ("trie", "tokens", "open_runs")

    def __init__(self, max_depth: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.tokens: list[int] = []
        self.open_runs: list[tuple[int, _Node, int]] = []  # (start, explicit node, depth)

    def sync(self, token_ids: Sequence[int]) -> None:
        """Counts the tokens of token_ids appended since the previous call."""
        seen, n = len(self.tokens), len(token_ids)
        if n < seen or (seen and token_ids[seen - 1] != self.tokens[-1]):
            self.trie = SuffixTrie(self.trie.max_depth)
            self.tokens, self.open_runs, seen = [], [], 0
        if n == seen:
            return
        # the whole text first: a run counted below sees every token, as the argument above needs
        self.tokens.extend(int(token) for token in token_ids[seen:n])
        trie, depth_limit = self.trie, self.trie.max_depth
        runs = self.open_runs + [(start, trie.root, 0) for start in range(seen, n)]
        self.open_runs = []
        for start, node, depth in runs:
            node, depth = trie.count_run(self.tokens, start, node, depth)
            if node.text is None and start + depth_limit > n:
                self.open_runs.append((start, node, depth))


class SuffixProposer:
    """Suffix decoding (vLLM's "suffix" method, after Arctic Inference's suffix decoding).

    Each running request has a SuffixTrie over its own prompt and outputs, extended as tokens
    are appended; one shared SuffixTrie holds the outputs of the last max_cached_requests
    finished requests (the oldest dropped first; 0 keeps none). Both are max_tree_depth deep,
    which bounds the matched context plus the proposal.

    To propose, the tries count as one: a token string's count is the sum of its counts in both.
    The longest suffix of the text that occurs followed by some token bounds the match; the match
    is the longest suffix within that bound that leaves room for the most draft tokens, at most
    min(k, floor(max_spec_factor x match length), max_tree_depth - match length), so a short match
    drafts little and a long one does not crowd out the draft. The proposal then follows the most
    frequent continuation, token by token, while the count of the proposal so far over the count of
    the matched suffix (the product of the frequencies of each step) stays >= min_token_prob.
    Ties go to the smaller token id.

    Cost: a call counts the tokens appended since the previous one (O(max_tree_depth) each),
    matches in O(max_tree_depth x log max_tree_depth) steps and proposes in O(k x followers);
    finish() adds and evicts O(output tokens x shared depth) nodes.
    """

    needs_pages = False  # proposes on the host, from tokens alone

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        if max_tree_depth < 2:
            raise ValueError(f"max_tree_depth must be at least 2, got {max_tree_depth}")
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {max_cached_requests}")
        if max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {max_spec_factor}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._requests: dict[str, _RequestSuffixes] = {}
        self._finished = SuffixTrie(max_tree_depth)
        self._finished_outputs: deque[list[int]] = deque()

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        if k <= 0 or len(token_ids) == 0:
            return []
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestSuffixes(self.max_tree_depth)
        state.sync(token_ids)
        tries = [state.trie]
        if self._finished_outputs:
            tries.append(self._finished)
        length = self._match_length(self._longest_match(tries, state.tokens), k)
        limit = self._draft_limit(length, k)
        if limit <= 0:
            return []
        suffix = state.tokens[len(state.tokens) - length :]
        cursors = [cursor for cursor in (trie.find(suffix) for trie in tries) if cursor is not None]
        return self._follow(cursors, limit)

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._requests.pop(request_id, None)
        if self.max_cached_requests == 0:
            return
        outputs = [int(token) for token in token_ids[num_prompt_tokens:]]
        if not outputs:
            return
        self._finished.add(outputs)
        self._finished_outputs.append(outputs)
        while len(self._finished_outputs) > self.max_cached_requests:
            self._finished.remove(self._finished_outputs.popleft())

    def _draft_limit(self, match_length: int, k: int) -> int:
        return min(k, math.floor(self.max_spec_factor * match_length + 1e-9))

    def _longest_match(self, tries: list[SuffixTrie], tokens: list[int]) -> int:
        """The length of the longest suffix of tokens (under max_tree_depth) that occurs followed
        by a token in some trie; 0 when none does. A suffix that does implies the same of every
        shorter one, so the length is found by bisection."""
        low, high = 0, min(len(tokens), self.max_tree_depth - 1)
        while low < high:
            mid = (low + high + 1) // 2
            suffix = tokens[len(tokens) - mid :]
            cursors = (trie.find(suffix) for trie in tries)
            if any(cursor is not None and SuffixTrie.has_followers(cursor) for cursor in cursors):
                low = mid
            else:
                high = mid - 1
        return low

    def _match_length(self, longest: int, k: int) -> int:
        """The longest match length up to longest that leaves room for the most draft tokens."""
        best, best_room = longest, -1
        for length in range(longest, 0, -1):
            room = min(self._draft_limit(length, k), self.max_tree_depth - length)
            if room > best_room:
                best, best_room = length, room
        return best

    def _follow(self, cursors: list[Cursor], limit: int) -> list[int]:
        """Up to limit tokens along the most frequent continuation of the string at cursors, while
        its count over the count of that string stays >= min_token_prob."""
        threshold = self.min_token_prob * sum(node.count for node, _ in cursors)
        draft: list[int] = []
        while len(draft) < limit:
            # a string followed by many tokens, none often enough, is let go without a look at them
            if sum(SuffixTrie.top_bound(cursor) for cursor in cursors) < threshold:
                break
            counts: dict[int, int] = {}
            for cursor in cursors:
                for token, count in SuffixTrie.followers(cursor):
                    counts[token] = counts.get(token, 0) + count
            if not counts:
                break
            best = max(counts.values())
            if best < threshold:
                break
            token = min(token for token, count in counts.items() if count == best)
            draft.append(token)
            steps = (SuffixTrie.step(cursor, token) for cursor in cursors)
            cursors = [cursor for cursor in steps if cursor is not None]
        return draft


def proposer_for(spec: SpeculativeConfig | None) -> Proposer | None:
    """Speculative decoding's proposer of a configuration (None: none)."""
    if spec is None or spec.method == "draft_model":  # (built by the engine: it needs the device)
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    return SuffixProposer(
        max_tree_depth=spec.suffix_decoding_max_tree_depth,
        max_cached_requests=spec.suffix_decoding_max_cached_requests,
        max_spec_factor=spec.suffix_decoding_max_spec_factor,
        min_token_prob=spec.suffix_decoding_min_token_prob,
    )
