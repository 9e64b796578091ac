import pytest

from jaxserve.engine import block_manager
from jaxserve.engine.block_manager import NULL_BLOCK_ID, BlockManager


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_null_page_is_never_handed_out():
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    assert bm.num_free_blocks == bm.num_usable_blocks == 4
    assert bm.allocate("a", 16)
    assert sorted(bm.block_ids("a")) == [1, 2, 3, 4]
    assert NULL_BLOCK_ID not in bm.block_ids("a")
    assert bm.num_free_blocks == 0 and bm.usage == 1.0


def test_allocate_grows_the_table_and_fails_without_side_effects():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    assert bm.allocate("a", 5)  # 2 pages
    first = bm.block_ids("a")
    assert len(first) == 2
    assert bm.allocate("a", 8)  # still 2 pages
    assert bm.block_ids("a") == first
    assert bm.allocate("a", 9)
    assert bm.block_ids("a")[:2] == first and len(bm.block_ids("a")) == 3
    assert bm.allocate("b", 4)
    assert bm.num_free_blocks == 1
    assert not bm.allocate("b", 12)  # needs 2 more, 1 free
    assert len(bm.block_ids("b")) == 1 and bm.num_free_blocks == 1
    assert not bm.allocate("c", 8)
    assert bm.block_ids("c") == []
    bm.free("a")
    bm.free("b")
    bm.free("unknown")  # ignored
    assert bm.num_free_blocks == 5 and bm.usage == 0.0
    assert all(bm.ref_count(b) == 0 for b in range(6))


def test_free_queue_is_lru_and_a_sequence_tail_goes_first():
    bm = BlockManager(num_blocks=9, block_size=2, enable_prefix_caching=True)
    assert bm.allocate("a", 6)
    bm.cache_full_blocks("a", tokens(6), 6)
    a = bm.block_ids("a")
    assert bm.allocate("b", 4)
    bm.cache_full_blocks("b", tokens(4, 50), 4)
    b = bm.block_ids("b")
    bm.free("a")
    bm.free("b")
    # Never-used pages first, then a's pages tail first, then b's pages tail first.
    assert bm.allocate("c", 2 * 8)
    assert bm.block_ids("c") == [6, 7, 8] + a[::-1] + b[::-1]


def test_anonymous_pages_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    assert bm.allocate("a", 3)  # page 1 full and cached, page 2 half full
    bm.cache_full_blocks("a", tokens(3), 3)
    cached, partial = bm.block_ids("a")
    assert bm.allocate("b", 2)
    bm.free("b")  # anonymous, freed last, but has nothing worth keeping
    bm.free("a")
    assert bm.allocate("c", 2)
    assert bm.block_ids("c") != [cached]
    assert bm.get_computed_blocks(tokens(5)) == ([cached], 2)


def test_prefix_hits_are_chained_full_pages_and_leave_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = tokens(10)
    assert bm.get_computed_blocks(prompt) == ([], 0)
    assert bm.allocate("a", 10)
    bm.cache_full_blocks("a", prompt, 10)  # pages 0..1 full, page 2 partial
    a = bm.block_ids("a")
    assert bm.num_cached_blocks == 2

    assert bm.get_computed_blocks(prompt) == (a[:2], 8)
    assert bm.get_computed_blocks(tokens(8)) == (a[:1], 4)  # the last token is never a hit
    assert bm.get_computed_blocks(tokens(9)) == (a[:2], 8)
    assert bm.get_computed_blocks(tokens(6) + [99, 99, 99]) == (a[:1], 4)
    # Same second page, different first page: the chain breaks at the first page.
    assert bm.get_computed_blocks([9, 9, 9, 9] + tokens(4, 4) + [0]) == ([], 0)


def test_cache_hits_share_pages_and_take_them_out_of_the_free_queue():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    prompt = tokens(9)
    assert bm.allocate("a", 9)
    bm.cache_full_blocks("a", prompt, 9)
    a = bm.block_ids("a")
    blocks, num_cached = bm.get_computed_blocks(prompt)
    assert bm.allocate("b", 9, blocks)
    assert bm.block_ids("b")[:2] == a[:2] and bm.block_ids("b")[2] != a[2]
    assert [bm.ref_count(x) for x in a] == [2, 2, 1]

    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 5
    # The cached pages are free (ref 0) but still hits; taking them must not let the
    # request overdraw the pool: 2 hits + 4 new pages > 5 free.
    blocks, num_cached = bm.get_computed_blocks(prompt)
    assert blocks == a[:2] and num_cached == 8
    assert not bm.allocate("c", 24, blocks)
    assert bm.num_free_blocks == 5 and bm.block_ids("c") == []
    assert bm.allocate("c", 20, blocks)
    assert bm.num_free_blocks == 0 and bm.block_ids("c")[:2] == a[:2]
    with pytest.raises(ValueError):
        bm.allocate("c", 24, blocks)


def test_a_failed_request_uncaches_only_the_pages_it_alone_holds():
    """Its step registered pages it never wrote; pages a live request shares were written before."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = tokens(9)
    assert bm.allocate("a", 9)
    bm.cache_full_blocks("a", prompt, 9)
    blocks, _ = bm.get_computed_blocks(tokens(5))  # b shares a's first page only
    assert bm.allocate("b", 5, blocks)
    bm.uncache("a")
    bm.free("a")
    assert bm.get_computed_blocks(prompt) == (blocks, 4)


def test_eviction_forgets_the_hash():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    assert bm.allocate("a", 4)
    bm.cache_full_blocks("a", tokens(4), 4)
    bm.free("a")
    assert bm.get_computed_blocks(tokens(5))[1] == 4
    assert bm.allocate("b", 2)  # evicts one of a's pages
    bm.cache_full_blocks("b", tokens(2, 70), 2)
    assert bm.get_computed_blocks(tokens(5))[1] < 4
    assert bm.get_computed_blocks(tokens(2, 70) + [0])[1] == 2


def test_duplicate_content_keeps_the_first_page_cached():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    for req in ("a", "b"):  # both computed the same prefix without a hit
        assert bm.allocate(req, 4)
        bm.cache_full_blocks(req, tokens(4), 4)
    assert bm.get_computed_blocks(tokens(5))[0] == bm.block_ids("a")
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 5
    assert bm.get_computed_blocks(tokens(5))[1] == 4


@pytest.mark.parametrize("hash_algo", ["builtin", "sha256"])
def test_hash_algorithms(hash_algo):
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, hash_algo=hash_algo)
    assert bm.allocate("a", 12)
    bm.cache_full_blocks("a", tokens(12), 12)
    assert bm.get_computed_blocks(tokens(13)) == (bm.block_ids("a"), 12)
    assert bm.get_computed_blocks(tokens(4) + tokens(9, 5)) == (bm.block_ids("a")[:1], 4)


@pytest.mark.parametrize("hash_algo", ["builtin", "sha256"])
def test_a_colliding_hash_never_serves_another_prompts_pages(hash_algo, monkeypatch):
    """Every page hashes alike (the worst a crafted prompt could do to any hash): different
    prompts never share a page, and a prompt still hits its own cached page."""
    monkeypatch.setitem(block_manager._HASH_FNS, hash_algo, lambda parent, page: 7)
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, hash_algo=hash_algo)
    assert bm.allocate("a", 12)
    bm.cache_full_blocks("a", tokens(12), 12)
    other = tokens(12, 100)
    assert bm.get_computed_blocks(other + [1]) == ([], 0)
    assert bm.allocate("b", 12)
    bm.cache_full_blocks("b", other, 12)
    assert not set(bm.block_ids("a")) & set(bm.block_ids("b"))
    assert bm.get_computed_blocks(tokens(4) + tokens(8, 50) + [1]) == (bm.block_ids("a")[:1], 4)


def test_a_page_cached_under_another_prefix_is_never_a_hit(monkeypatch):
    """A hash blind to the parent (a chain collision): the same page after another prefix misses."""
    monkeypatch.setitem(block_manager._HASH_FNS, "builtin", lambda parent, page: hash(page))
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, hash_algo="builtin")
    for req, start in (("a", 0), ("b", 100)):
        assert bm.allocate(req, 8)
        bm.cache_full_blocks(req, tokens(8, start), 8)
    shifted = tokens(4, 100) + tokens(4, 4)  # b's first page, then a's second page
    assert bm.get_computed_blocks(shifted + [1]) == (bm.block_ids("b")[:1], 4)


def test_sha256_is_the_default_and_chains_the_prefix():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    assert bm.hash_fn is block_manager._HASH_FNS["sha256"]
    first = block_manager.page_hashes(tokens(8), 4, hash_fn=bm.hash_fn)
    moved = block_manager.page_hashes(tokens(4, 9) + tokens(4, 4), 4, hash_fn=bm.hash_fn)
    assert len(first[0]) == 32 and first[1] != moved[1]  # same page, other parent: other hash


def test_bad_hash_algo_is_refused():
    with pytest.raises(ValueError, match="hash_algo"):
        BlockManager(4, 4, True, hash_algo="md5")


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert bm.allocate("a", 12)
    bm.cache_full_blocks("a", tokens(12), 12)
    assert bm.get_computed_blocks(tokens(13)) == ([], 0)
    assert bm.num_cached_blocks == 0


def test_reset_prefix_cache_only_when_idle():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    assert bm.allocate("a", 8)
    bm.cache_full_blocks("a", tokens(8), 8)
    assert not bm.reset_prefix_cache()
    bm.free("a")
    assert bm.get_computed_blocks(tokens(9))[1] == 8
    assert bm.reset_prefix_cache()
    assert bm.get_computed_blocks(tokens(9)) == ([], 0)
    assert bm.num_cached_blocks == 0
