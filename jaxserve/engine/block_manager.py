"""The KV page pool: which pages each request owns, and which pages can be reused.

Only the Scheduler calls this class (see DESIGN.md, "Who may touch what"). The runner
never sees it: it receives each sequence's page table inside the SchedulerOutput.

Prefix caching works on *full* pages. A full page is named by a chained hash of its
tokens and of the hash of the page before it (sha256 by default), so equal hashes mean equal
prefixes, not just equal pages. A hit is also checked against the (parent hash, tokens) the
page was cached under, so even a colliding hash (the opt-in 64-bit `builtin` one, which
crafted prompts can collide) costs a miss, never another prompt's KV. A page whose last user has finished keeps its hash and its KV while it
sits in the free queue; it is reused as a cache hit until allocation evicts it. The free
queue is in LRU order, so the pages freed longest ago are evicted first.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Page 0 is never handed out: padded page-table entries on the device point at it, so
# whatever garbage the runner writes there hurts no one.
NULL_BLOCK_ID = 0

BlockHash = Hashable
PageKey = tuple  # (parent hash, token ids): what a page's hash is taken over


@dataclass
class PrefixCacheStats:
    """Counted once per request, on its first admission (recomputes after a preemption
    would otherwise inflate the hit rate with the request's own pages)."""

    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_queries: int, num_hits: int) -> None:
        self.requests += 1
        self.queries += num_queries
        self.hits += num_hits


def _hash_builtin(parent: BlockHash | None, tokens: tuple[int, ...]) -> BlockHash:
    return hash((parent, tokens))


def _hash_sha256(parent: BlockHash | None, tokens: tuple[int, ...]) -> BlockHash:
    # The parent's 32-byte digest (none for a first page), then the page's ids as int64: one
    # encoding per (parent, tokens), and a collision-resistant digest over it.
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


_HASH_FNS = {"builtin": _hash_builtin, "sha256": _hash_sha256}
DEFAULT_HASH_ALGO = "sha256"


def pages(
    token_ids: Sequence[int],
    block_size: int,
    start: int = 0,
    stop: int | None = None,
    parent: BlockHash | None = None,
    hash_fn=_hash_sha256,
) -> Iterator[tuple[BlockHash, PageKey]]:
    """(chained hash, (parent hash, token ids)) of full pages start..stop-1 of token_ids
    (default: every full page), `parent` being the hash of page start-1; lazy, so a lookup can
    stop at its first miss."""
    stop = len(token_ids) // block_size if stop is None else stop
    for i in range(start, stop):
        key = (parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        parent = hash_fn(*key)
        yield parent, key


def page_hashes(token_ids: Sequence[int], block_size: int, hash_fn=_hash_builtin) -> list[BlockHash]:
    """The chained hashes of every full page (the data-parallel router's view of a prompt)."""
    return [page_hash for page_hash, _ in pages(token_ids, block_size, hash_fn=hash_fn)]


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        hash_algo: str = DEFAULT_HASH_ALGO,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (page 0 is reserved), got {num_blocks}.")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        if hash_algo not in _HASH_FNS:
            raise ValueError(
                f"prefix_caching_hash_algo must be one of {sorted(_HASH_FNS)}, got {hash_algo!r}."
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = _HASH_FNS[hash_algo]  # how a page's tokens and its parent's hash are hashed
        if enable_prefix_caching and hash_algo == "builtin":
            logger.warning(
                "--prefix-caching-hash-algo builtin: 64-bit Python hashes, which crafted prompts can "
                "collide (a collision costs a cache miss: every hit is checked against its tokens)."
            )

        self._ref_counts = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._block_key: list[PageKey | None] = [None] * num_blocks  # what the hash was taken over
        self._cached: dict[BlockHash, int] = {}  # hash of a full page -> the page holding it
        # Pages with ref count 0, head = next to be evicted. An OrderedDict gives O(1)
        # removal from the middle, which a cache hit on a free page needs.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._frozen: dict[str, tuple[int, ...]] = {}  # each table as a tuple (block_table)
        # Chained hashes of the request's full pages registered so far; the next page's
        # hash chains from the last one.
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self.stats = PrefixCacheStats()

    # ---- reading -----------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Pages allocation may take, cached-but-unreferenced ones included."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def block_ids(self, req_id: str) -> list[int]:
        return list(self._tables.get(req_id, ()))

    def block_table(self, req_id: str) -> tuple[int, ...]:
        """The request's page table as a tuple, made again only when it grows (allocate)."""
        return self._frozen.get(req_id, ())

    def num_hashed_pages(self, req_id: str) -> int:
        """The leading pages of the request's table whose hash is recorded (cached or cache hits)."""
        return len(self._req_hashes.get(req_id, ()))

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache lookup -------------------------------------------------------------

    def root(self, lora_int_id: int) -> BlockHash:
        """The parent hash of a LoRA request's first page: pages computed with one adapter are
        never found by a request with another (or none), whose chains start elsewhere."""
        return self.hash_fn(None, (-lora_int_id,))

    def embeds_root(self, parent: BlockHash | None, digest: bytes) -> BlockHash:
        """The parent hash of the first page of a prompt given as embeddings (after its adapter's
        root, if any): the digest of their bytes, so that only identical embeddings share pages
        (such a prompt's token ids are placeholders)."""
        return self.hash_fn(parent, struct.unpack("<4q", digest[:32]))

    def get_computed_blocks(
        self, token_ids: Sequence[int], root: BlockHash | None = None
    ) -> tuple[list[int], int]:
        """The pages of the longest cached prefix of full pages, and the tokens they hold
        (`root`: the chain's start, see root()).

        Stops one token short of the whole sequence: the last token must be fed to the
        model so that there are logits to sample the next token from.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        blocks: list[int] = []
        for page_hash, key in pages(
            token_ids, bs, stop=(len(token_ids) - 1) // bs, parent=root, hash_fn=self.hash_fn
        ):
            block = self._cached.get(page_hash)
            if block is None or self._block_key[block] != key:
                break
            blocks.append(block)
        return blocks, len(blocks) * bs

    # ---- allocation ----------------------------------------------------------------------

    def allocate(self, req_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Grow the request's page table to hold num_tokens tokens.

        computed_blocks (from get_computed_blocks) are only accepted on a request's first
        allocation; they are shared, not copied. Returns False and changes nothing when the
        pool cannot supply the pages.
        """
        table = self._tables.get(req_id)
        if table is not None and not computed_blocks and len(table) * self.block_size >= num_tokens:
            return True  # the common decode step: the last page has room
        if computed_blocks and table:
            raise ValueError(f"Request {req_id!r} already has pages; cache hits only apply to a new table.")
        have = len(table) if table else 0
        num_new = self.num_blocks_for(num_tokens) - have - len(computed_blocks)
        # A free page that is a cache hit leaves the free queue, so it does not count twice.
        num_free_hits = sum(1 for b in computed_blocks if self._ref_counts[b] == 0)
        if num_new > self.num_free_blocks - num_free_hits:
            return False

        if table is None:
            table = self._tables[req_id] = []
            self._req_hashes[req_id] = []
        for block in computed_blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
            table.append(block)
            self._req_hashes[req_id].append(self._block_hash[block])
        for _ in range(max(num_new, 0)):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_counts[block] = 1
            table.append(block)
        self._frozen[req_id] = tuple(table)
        return True

    def _evict(self, block: int) -> None:
        block_hash = self._block_hash[block]
        if block_hash is not None:
            self._block_hash[block] = self._block_key[block] = None
            if self._cached.get(block_hash) == block:
                del self._cached[block_hash]

    def cache_full_blocks(
        self, req_id: str, token_ids: Sequence[int], num_tokens: int, root: BlockHash | None = None
    ) -> None:
        """Register the request's pages that are full once num_tokens tokens are written.

        Called when their KV is (being) written; calling it again is cheap and idempotent.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables[req_id]
        hashes = self._req_hashes[req_id]
        start, stop = len(hashes), min(num_tokens // self.block_size, len(table))
        last = hashes[-1] if hashes else root
        for i, (page_hash, key) in enumerate(
            pages(token_ids, self.block_size, start, stop, last, self.hash_fn), start
        ):
            hashes.append(page_hash)
            block = table[i]
            # If another page already holds this prefix (two requests computed it at the
            # same time), keep that one; this page stays anonymous and is evicted first.
            if page_hash not in self._cached:
                self._cached[page_hash] = block
                self._block_hash[block], self._block_key[block] = page_hash, key

    def uncache(self, req_id: str) -> None:
        """Forget the hashes of the request's pages that no other request holds: its step failed,
        and a page is registered when the step that writes it is planned, so its KV may be
        missing (a page shared with a live request was written by an earlier step)."""
        for block in self._tables.get(req_id, ()):
            if self._ref_counts[block] == 1:
                self._evict(block)

    def free(self, req_id: str) -> None:
        """Drop the request's references; unknown ids are ignored.

        Walks the table backwards so that the end of a sequence lands in the free queue
        before its beginning and is evicted first: a later request is likelier to share the
        beginning. Anonymous pages (nothing cached in them) go to the head: they are
        worth nothing, so they are reused before any cached page.
        """
        table = self._tables.pop(req_id, None)
        self._req_hashes.pop(req_id, None)
        self._frozen.pop(req_id, None)
        if table is None:
            return
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._block_hash[block] is None:
                    self._free.move_to_end(block, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any page is in use, as in vLLM,
        because a running request's table still points at pages whose hash it recorded."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        self._block_key = [None] * self.num_blocks
        return True
