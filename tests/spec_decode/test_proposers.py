"""The host-side draft-token proposers (jaxserve/spec_decode/proposers.py), checked against
brute-force references on random token lists."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest

from jaxserve.spec_decode.proposers import (
    NgramProposer,
    Proposer,
    SuffixProposer,
    SuffixTrie,
    longest_ngram_continuation,
)

# ---------------------------------------------------------------------------------------------
# ngram


def reference_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup by direct comparison: the longest n first, the most recent occurrence first."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_both_proposers_have_the_interface():
    proposers: list[Proposer] = [NgramProposer(1, 3), SuffixProposer()]
    for proposer in proposers:
        assert proposer.propose("r", [], 0, 4) == []
        assert proposer.propose("r", [1, 2, 1, 2, 1], 2, 0) == []
        assert proposer.propose("r", [1, 2, 1, 2, 1], 2, -1) == []
        proposer.finish("r", [1, 2, 1, 2, 1], 2)
        proposer.finish("never-seen", [3], 1)


def test_ngram_prefers_the_longest_match():
    # [2, 3] also occurs later (followed by 20), but [1, 2, 3] occurs only at the start
    tokens = [1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 1, 2, 3]
    assert NgramProposer(1, 3).propose("r", tokens, 3, 2) == [10, 11]
    assert NgramProposer(1, 2).propose("r", tokens, 3, 2) == [20, 21]


def test_ngram_prefers_the_most_recent_occurrence():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert NgramProposer(2, 2).propose("r", tokens, 2, 2) == [2, 5]


def test_ngram_respects_min_n():
    tokens = [1, 2, 3, 9, 3]  # only the 1-gram [3] occurs earlier
    assert NgramProposer(2, 4).propose("r", tokens, 2, 3) == []
    assert NgramProposer(1, 4).propose("r", tokens, 2, 3) == [9, 3]


def test_ngram_proposes_fewer_than_k_near_the_end():
    assert NgramProposer(2, 2).propose("r", [1, 2, 3, 1, 2], 2, 5) == [3, 1, 2]
    assert NgramProposer(1, 1).propose("r", [7, 7], 1, 5) == [7]


def test_ngram_rejects_bad_sizes():
    with pytest.raises(ValueError):
        NgramProposer(0, 3)
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def test_ngram_matches_the_reference_on_random_lists():
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(rng.choice((2, 3, 5))) for _ in range(rng.randrange(0, 60))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(0, 6)
        expected = reference_ngram(tokens, min_n, max_n, k)
        assert NgramProposer(min_n, max_n).propose("r", tokens, 0, k) == expected
        assert longest_ngram_continuation(np.asarray(tokens, np.int32), min_n, max_n, k) == expected
        assert len(expected) <= max(k, 0)


def test_ngram_cache_follows_a_growing_list_and_a_reused_id():
    rng = random.Random(1)
    proposer = NgramProposer(1, 4)
    for _ in range(20):
        tokens: list[int] = []
        for _ in range(40):
            tokens.extend(rng.randrange(4) for _ in range(rng.randint(0, 40)))
            assert proposer.propose("r", tokens, 0, 5) == reference_ngram(tokens, 1, 4, 5)
        proposer.finish("r", tokens, 0)
        assert not proposer._buffers
    # a list that shrank or changed under the same id, without finish(), is copied again
    proposer.propose("r", [1, 2, 3, 1, 2, 3, 1], 0, 3)
    assert proposer.propose("r", [4, 5, 4], 0, 3) == [5, 4]
    assert proposer.propose("r", [4, 5, 6, 4], 0, 3) == [5, 6, 4]


# ---------------------------------------------------------------------------------------------
# suffix decoding


def occurrences(texts: list[list[int]], string: list[int]) -> int:
    n = len(string)
    return sum(text[i : i + n] == string for text in texts for i in range(len(text) - n + 1))


def reference_suffix(texts: list[list[int]], tokens: list[int], depth: int, k: int, factor: float, p: float):
    """Suffix decoding by counting occurrences directly in every text (the request's own first)."""
    vocab = sorted({token for text in texts for token in text})
    length = len(tokens)
    longest = 0
    for m in range(min(length, depth - 1), 0, -1):
        if any(occurrences(texts, tokens[length - m :] + [t]) for t in vocab):
            longest = m
            break

    def room(m: int) -> int:
        return min(k, math.floor(factor * m + 1e-9), depth - m)

    # the longest match among those that leave room for the most draft tokens
    match = max(range(longest + 1), key=lambda m: (room(m), m)) if longest else 0
    limit = min(k, math.floor(factor * match + 1e-9))
    string = tokens[length - match :]
    base = occurrences(texts, string)
    draft: list[int] = []
    while len(draft) < limit and len(string) < depth:
        count, token = max((occurrences(texts, string + [t]), -t) for t in vocab)
        if count == 0 or count < p * base:
            break
        draft.append(-token)
        string = string + [-token]
    return draft


def trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every token string in the trie with its count, implicit chains spelled out."""
    counts: dict[tuple[int, ...], int] = {}
    stack = [((), trie.find([]))]
    while stack:
        path, cursor = stack.pop()
        for token, count in SuffixTrie.followers(cursor):
            counts[path + (token,)] = count
            stack.append((path + (token,), SuffixTrie.step(cursor, token)))
    return counts


def substring_counts(texts: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: Counter[tuple[int, ...]] = Counter()
    for text in texts:
        for start in range(len(text)):
            for end in range(start + 1, min(start + depth, len(text)) + 1):
                counts[tuple(text[start:end])] += 1
    return dict(counts)


def test_suffix_proposes_a_finished_requests_output():
    proposer = SuffixProposer()
    proposer.finish("a", [100, 101, 1, 2, 3, 4, 5, 6], 2)
    assert proposer.propose("b", [50, 1, 2, 3], 4, 10) == [4, 5, 6]
    assert proposer.propose("c", [50, 1, 2, 3], 4, 2) == [4, 5]
    # the prompt of a finished request is not kept
    assert proposer.propose("d", [60, 100], 2, 5) == []


def test_suffix_proposes_from_the_requests_own_text():
    proposer = SuffixProposer(max_cached_requests=0)
    assert proposer.propose("r", [1, 2, 3, 4, 1, 2], 2, 5) == [3, 4]
    proposer.finish("r", [1, 2, 3, 4, 1, 2], 2)
    assert not proposer._requests
    assert proposer.propose("s", [1, 2], 2, 5) == []  # 0 cached requests: nothing was kept


def test_suffix_respects_min_token_prob():
    outputs = [[7, 8, 200 + i] for i in range(20)]  # after [7, 8], each continuation 1 time in 20
    strict, loose = SuffixProposer(min_token_prob=0.1), SuffixProposer(min_token_prob=0.04)
    for i, output in enumerate(outputs):
        strict.finish(f"old{i}", [1] + output, 1)
        loose.finish(f"old{i}", [1] + output, 1)
    assert strict.propose("r", [9, 7, 8], 1, 4) == []
    assert loose.propose("r", [9, 7, 8], 1, 4) == [200]  # ties go to the smaller token id


def test_suffix_probability_is_that_of_the_whole_proposal():
    # [1, 2, 3] occurs 5 times (4 outputs and the request); 4 follows 4 of them, 4 then 5 only 2
    for p, expected in ((0.45, [4]), (0.3, [4, 5]), (0.9, [])):
        proposer = SuffixProposer(min_token_prob=p)
        for i, last in enumerate((5, 5, 6, 6)):
            proposer.finish(f"old{i}", [0, 1, 2, 3, 4, last], 1)
        assert proposer.propose("r", [9, 1, 2, 3], 1, 8) == expected


def test_suffix_max_spec_factor_limits_by_match_length():
    for factor, context, expected in (
        (1.0, [99, 5, 6], [7, 8]),
        (2.0, [99, 5, 6], [7, 8, 9, 10]),
        (0.5, [99, 5, 6], [7]),
        (0.4, [99, 5, 6], []),
        (1.0, [99, 3, 4, 5, 6], [7, 8, 9, 10]),
    ):
        proposer = SuffixProposer(max_spec_factor=factor)
        proposer.finish("old", [0] + list(range(1, 21)), 1)
        assert proposer.propose("r", context, 1, 10) == expected, factor


def test_suffix_match_leaves_room_for_the_draft():
    # the longest match (23 tokens) would leave room for 1 token under the 24-deep tries
    chunk = list(range(100, 130))
    assert SuffixProposer().propose("r", chunk * 3, 30, 5) == list(range(100, 105))
    # 6 deep, k = 3: the longest match, [1..5], leaves room for 1 token, [3, 4, 5] for 3
    proposer = SuffixProposer(max_tree_depth=6, max_cached_requests=0)
    assert proposer.propose("r", [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5], 1, 3) == [6, 7, 8]


def test_suffix_evicts_the_oldest_finished_request():
    proposer = SuffixProposer(max_cached_requests=2)
    for i, output in enumerate(([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])):
        proposer.finish(f"old{i}", [0] + output, 1)
    assert proposer.propose("r", [1, 2], 2, 2) == []
    assert proposer.propose("s", [5, 6], 2, 2) == [7, 8]
    assert proposer.propose("t", [9, 10], 2, 2) == [11, 12]
    assert proposer._finished.find([1]) is None
    assert trie_counts(proposer._finished) == substring_counts([[5, 6, 7, 8], [9, 10, 11, 12]], 24)


def test_suffix_trie_add_and_remove_count_every_run():
    rng = random.Random(2)
    for _ in range(30):
        depth = rng.randint(1, 6)
        trie = SuffixTrie(depth)
        texts = [[rng.randrange(3) for _ in range(rng.randrange(0, 25))] for _ in range(6)]
        for text in texts:
            trie.add(text)
        assert trie_counts(trie) == substring_counts(texts, depth)
        for _ in range(3):
            trie.remove(texts.pop(rng.randrange(len(texts))))
            assert trie_counts(trie) == substring_counts(texts, depth)


def test_suffix_incremental_trie_equals_a_rebuilt_one():
    rng = random.Random(3)
    for _ in range(20):
        depth = rng.randint(2, 7)
        proposer = SuffixProposer(max_tree_depth=depth, max_cached_requests=0)
        tokens: list[int] = []
        for _ in range(15):
            tokens.extend(rng.randrange(4) for _ in range(rng.randint(0, 12)))
            draft = proposer.propose("r", tokens, 0, 4)
            rebuilt = SuffixTrie(depth)
            rebuilt.add(tokens)
            if tokens:
                assert trie_counts(proposer._requests["r"].trie) == trie_counts(rebuilt)
            assert draft == SuffixProposer(max_tree_depth=depth, max_cached_requests=0).propose(
                "fresh", tokens, 0, 4
            )
        # a changed list under the same id is counted again
        tokens = tokens[: len(tokens) // 2] + [9]
        proposer.propose("r", tokens, 0, 4)
        assert trie_counts(proposer._requests["r"].trie) == substring_counts([tokens], depth)


def test_suffix_matches_the_reference_on_random_lists():
    rng = random.Random(4)
    for _ in range(200):
        depth = rng.randint(2, 6)
        cached = rng.randint(0, 3)
        factor = rng.choice((0.5, 1.0, 2.0))
        p = rng.choice((0.0, 0.1, 0.3, 0.6))
        proposer = SuffixProposer(depth, cached, factor, p)
        outputs = []
        for i in range(rng.randint(0, 5)):
            prompt = [rng.randrange(4) for _ in range(rng.randrange(3))]
            output = [rng.randrange(4) for _ in range(rng.randrange(10))]
            proposer.finish(f"old{i}", prompt + output, len(prompt))
            outputs.append(output)
        kept = [output for output in outputs if output][-cached:] if cached else []
        tokens: list[int] = []
        for _ in range(3):
            tokens.extend(rng.randrange(4) for _ in range(rng.randint(0, 8)))
            k = rng.randint(0, 5)
            draft = proposer.propose("r", tokens, 0, k)
            assert len(draft) <= max(k, 0)
            expected = reference_suffix([tokens] + kept, tokens, depth, k, factor, p) if tokens else []
            assert draft == expected
