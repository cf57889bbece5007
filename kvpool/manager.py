"""KVCacheManager: which blocks each request owns, the slots its tokens live in, and the
prefix cache over them.

Owns: the request -> block ids map (a request's *block table*), each request's count of live
(computed) tokens, its memoized chain of block hashes, and the copy-on-write copies queued
for the next step. The scheduler asks it for room (``allocate_slots``) and gives room back
(``free``); it sees block ids only through the values returned here and never changes them.

Prefix caching (``enable_prefix_caching``), one request's life::

    get_cached_prefix()   leading full blocks already cached -> CachedPrefix
    allocate_slots(.., cached)   share those blocks (ref + 1), allocate the rest
    ... the step computes [num_computed, num_computed + num_new) ...
    commit_computed()     register the hashes of blocks that became full and computed
    free()                ref - 1; ownerless hashed blocks stay cached, evictable (LRU)

Beside it: ``CachedPrefix`` (kvpool/prefix_cache.py). ``check_integrity()`` asserts the
invariants listed on ``KVCacheManager``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress

from kvpool.block_pool import BlockPool
from kvpool.prefix_cache import BlockHash, CachedPrefix, TokenSource, extend_chain
from kvpool.stats import KVCacheStats

__all__ = ["CachedPrefix", "KVCacheManager", "slots_for"]


def slots_for(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Slots of positions ``[start, end)`` in a block table.

    Args:
        block_ids: the block table (position ``p`` lives in ``block_ids[p // block_size]``).
        block_size: token slots per block.
        start, end: the half-open position range.
    Returns:
        ``block * block_size + offset`` for every position, in order.
    """
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


class KVCacheManager:
    """Block tables over a ``BlockPool``, with an optional prefix cache.

    A request with ``n`` tokens in the cache owns ``ceil(n / block_size)`` blocks; token at
    position ``p`` lives in slot ``block_table[p // block_size] * block_size + p % block_size``::

        positions  0 ........ 15 | 16 ....... 31 | 32 .. 37
        blocks     block_table[0] | block_table[1] | block_table[2] (6 of 16 slots used)

    NOTE: a block is never written while it is shared or cached. Hashes are registered only
    for full, computed blocks, and a request writes only at and after its computed length,
    so every block from ``live // block_size`` on is private (ref 1) and unhashed
    (``check_integrity``). The one exception by construction, a fully cached sequence that
    must recompute its last token, is resolved by copy-on-write at allocation.
    """

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False
    ) -> None:
        """Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        enable_prefix_caching: share cached full blocks between requests. The engine turns
            it on from ``KVPoolConfig`` (on by default there); a bare manager keeps it off so
            unit tests see cache-free block ids unless they ask.
        """
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}
        # Computed tokens per request (its live slots), as the scheduler last reported them.
        self._num_live: dict[str, int] = {}
        # Leading blocks of each table whose hash has been looked up or registered.
        self._num_hashed: dict[str, int] = {}
        # Memoized hash chains; they outlive a preemption (tokens only grow).
        self._chains: dict[str, list[BlockHash]] = {}
        self._blocks_to_copy: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free, plus evictable cached ones."""
        return self.pool.num_available

    @property
    def num_evictable_blocks(self) -> int:
        """Ownerless blocks still holding cached prefix content."""
        return self.pool.num_evictable

    @property
    def num_used_blocks(self) -> int:
        """Blocks owned by at least one request."""
        return self.pool.num_used

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.pool.num_used / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Args:
            num_tokens: tokens to hold.
        Returns:
            Blocks needed to hold them: ``ceil(num_tokens / block_size)``.
        """
        return -(-num_tokens // self.block_size)

    def fits_in_empty_pool(self, num_tokens: int) -> bool:
        """Args:
            num_tokens: the most tokens a request may hold.
        Returns:
            Whether such a request could ever run (alone, with the pool empty).
        """
        return self.num_blocks_for(num_tokens) <= self.pool.num_blocks

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Args:
            request_id: the request (unknown ids own no blocks).
            num_tokens: tokens it should hold in total.
        Returns:
            Blocks it still lacks for that (0 if it already has enough).
        """
        have = len(self._block_tables.get(request_id, ()))
        return max(0, self.num_blocks_for(num_tokens) - have)

    # ---- prefix cache ---------------------------------------------------------------------

    def get_cached_prefix(
        self, request_id: str, num_tokens: int, token_ids: TokenSource
    ) -> CachedPrefix:
        """Find the longest run of leading full blocks of a request already in the cache.

        A pure lookup: no ref count changes, no stats. Hashing stops at the first miss.

        Args:
            request_id: the request (its hash chain is memoized under this id).
            num_tokens: its known tokens (prompt + output so far), at least 1.
            token_ids: its tokens by position range.
        Returns:
            The hit (empty when prefix caching is off).
        """
        if not self.enable_prefix_caching:
            return CachedPrefix((), num_tokens, 0, 0)
        chain = self._chains.setdefault(request_id, [])
        hit: list[int] = []
        next_hash = None
        for i in range(num_tokens // self.block_size):
            extend_chain(chain, i + 1, self.block_size, token_ids)
            block_id = self.pool.lookup(chain[i])
            if block_id is None:
                next_hash = chain[i]
                break
            hit.append(block_id)
        num_cached = len(hit) * self.block_size
        return CachedPrefix(tuple(hit), num_tokens, num_cached, min(num_cached, num_tokens - 1),
                            next_hash)  # fmt: skip

    def new_block_hashes(
        self, request_id: str, start: int, end: int, token_ids: TokenSource
    ) -> list[BlockHash]:
        """Hashes of the blocks a step computing positions ``[start, end)`` makes full::

            blocks   | full before | full after  | full after  | partial |
                     0      start // bs ..... end // bs (excl.)

        Args:
            request_id: the request.
            start, end: the positions the step computes.
            token_ids: its tokens by position range (at least up to ``end``).
        Returns:
            Those hashes, in block order (empty when prefix caching is off).
        """
        first, last = start // self.block_size, end // self.block_size
        if not self.enable_prefix_caching or last <= first:
            return []
        chain = self._chains.setdefault(request_id, [])
        extend_chain(chain, last, self.block_size, token_ids)
        return chain[first:last]

    def commit_computed(
        self, request_id: str, num_computed_tokens: int, token_ids: TokenSource
    ) -> None:
        """Record that a step computed the request up to ``num_computed_tokens``: count them
        as live, and register every block that is now full under its hash (once).

        Args:
            request_id: a request that owns blocks for those tokens.
            num_computed_tokens: its computed tokens after the step.
            token_ids: its tokens by position range.
        """
        table = self._block_tables[request_id]
        if not 0 <= num_computed_tokens <= len(table) * self.block_size:
            raise ValueError(
                f"{request_id!r} owns {len(table)} blocks, not {num_computed_tokens} tokens"
            )
        self._num_live[request_id] = num_computed_tokens
        first = self._num_hashed[request_id]
        last = num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or last <= first:
            return
        chain = self._chains.setdefault(request_id, [])
        extend_chain(chain, last, self.block_size, token_ids)
        for i in range(first, last):
            # False when another request computed the same block first; this copy then
            # stays unhashed and is recycled through the free list.
            self.pool.cache_block(table[i], chain[i])
        self._num_hashed[request_id] = last

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """Hand over the copy-on-write copies queued by ``allocate_slots`` since the last
        call. The runner must perform them (``KVCacheStorage.copy_blocks``) before the
        forward pass of the step that allocated them.

        Returns:
            ``(src_block_id, dst_block_id)`` pairs, in order.
        """
        copies, self._blocks_to_copy = self._blocks_to_copy, []
        return copies

    # ---- allocation -----------------------------------------------------------------------

    def allocate_slots(
        self, request_id: str, num_tokens: int, cached: CachedPrefix | None = None
    ) -> list[int] | None:
        """Grow ``request_id``'s block table so it holds ``num_tokens`` tokens in total.

        Args:
            request_id: the request (a new id starts an empty table).
            num_tokens: tokens the request will have in the cache after this step
                (computed so far + scheduled now), or more to reserve ahead.
            cached: on a request's first allocation only, its ``get_cached_prefix()``: the
                hit blocks are shared and only the rest is allocated (counted as a
                prefix-cache query either way).
        Returns:
            The newly allocated block ids (possibly empty), or ``None`` if the pool has too
            few free and evictable blocks, in which case nothing changes.
        """
        if cached is not None and request_id in self._block_tables:
            raise ValueError(f"{request_id!r} already owns blocks: no cached prefix to take")
        if cached is not None and cached.block_ids:
            return self._allocate_with_prefix(request_id, num_tokens, cached)
        table = self._block_tables.get(request_id)
        if cached is None and table is not None and len(table) * self.block_size >= num_tokens:
            return []  # most decodes: the last block has room
        need = self.num_new_blocks_needed(request_id, num_tokens)
        if need > self.pool.num_available:
            return None
        new_ids = self.pool.allocate(need)
        if request_id not in self._block_tables:
            self._block_tables[request_id] = []
            self._num_live[request_id] = 0
            self._num_hashed[request_id] = 0
        self._block_tables[request_id].extend(new_ids)
        if cached is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += cached.num_tokens
        return new_ids

    def _allocate_with_prefix(
        self, request_id: str, num_tokens: int, cached: CachedPrefix
    ) -> list[int] | None:
        """First allocation of a request with a cache hit::

            hit blocks   | h0 | h1 | h2 |            shared: ref + 1 (revived if evictable)
            new table    | h0 | h1 | h2 | new | new  (up to num_tokens)

            fully cached | h0 | h1 | h2 |            every token cached (block-aligned)
            new table    | h0 | h1 | c2 |            c2 = private copy of h2 (queued copy);
                                                     the last token is rewritten into c2

        All or nothing: ``None`` (nothing changes) if the pool cannot hold it.
        """
        if num_tokens < cached.num_computed_tokens:
            raise ValueError(f"{num_tokens} tokens cannot hold the cached prefix")
        hit = list(cached.block_ids)
        kept = hit[:-1] if cached.copies_last_block else hit
        need = self.num_blocks_for(num_tokens) - len(kept)
        # Reviving an evictable hit block takes it out of the available count.
        revived = sum(1 for block_id in hit if self.pool.ref_count(block_id) == 0)
        if need + revived > self.pool.num_available:
            return None
        # Share first: allocating first could evict the very blocks that hit.
        self.pool.share(hit)
        new_ids = self.pool.allocate(need)
        if cached.copies_last_block:
            # NOTE: the source is released right away; it cannot be overwritten before the
            # copy runs, since copies run before the step's forward pass and are gathered
            # before they are scattered (KVCacheStorage.copy_blocks).
            self._blocks_to_copy.append((hit[-1], new_ids[0]))
            self.pool.free([hit[-1]])
        self._block_tables[request_id] = kept + new_ids
        self._num_live[request_id] = cached.num_computed_tokens
        self._num_hashed[request_id] = len(kept)
        self.prefix_cache_queries += cached.num_tokens
        self.prefix_cache_hits += cached.num_computed_tokens
        return new_ids

    def free(self, request_id: str, *, forget: bool = True) -> None:
        """Return all of ``request_id``'s blocks to the pool, tail first, and drop its table.

        Blocks still shared stay with their other owners; ownerless blocks that hold a hash
        become evictable (the tail of a prefix first, so its head, shared the most, is
        evicted last); the rest go to the free list.

        Args:
            request_id: the request; an unknown id is ignored, so freeing twice is safe at
                this level (the pool itself raises on a double free of a block).
            forget: also forget the request's memoized block hashes. Pass False on
                preemption: the request is looked up again when it is re-admitted.
        """
        block_ids = self._block_tables.pop(request_id, None)
        self._num_live.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        if forget:
            self._chains.pop(request_id, None)
        if block_ids:
            self.pool.free(block_ids[::-1])

    def rollback_slots(self, request_id: str, num_tokens: int, *, min_blocks: int = 0) -> int:
        """Give back the slots of tokens a step wrote but that were rejected (speculative
        decoding): the request keeps the blocks that hold its first ``num_tokens`` tokens,
        or ``min_blocks`` if that is more, and the blocks after them return to the pool::

            table    | b0 | b1 | b2 | b3 |        num_tokens = 20, block_size = 16
            kept     | b0 | b1 |                  b2, b3 held only rejected slots: freed

        The rejected slots in a kept block are simply overwritten later: a block is hashed
        only once it is full of computed tokens (``commit_computed``), and the scheduler
        commits the accepted count only.

        Args:
            request_id: a request that owns blocks.
            num_tokens: its tokens that stay (its computed tokens after the step).
            min_blocks: blocks it held before the step allocated the speculative slots (a
                reservation, ``block_allocation="reserve"``, is never given back).
        Returns:
            The number of blocks returned to the pool.
        """
        table = self._block_tables[request_id]
        if num_tokens < self._num_live[request_id]:
            raise ValueError(
                f"{request_id!r}: cannot roll back below its {self._num_live[request_id]} "
                f"committed tokens to {num_tokens}"
            )
        keep = max(self.num_blocks_for(num_tokens), min_blocks)
        tail = table[keep:]
        if not tail:
            return 0
        # NOTE: every block past the live tokens is private and unhashed (class invariant),
        # so these go straight to the free list.
        del table[keep:]
        self.pool.free(tail[::-1])
        return len(tail)

    # ---- views ----------------------------------------------------------------------------

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """Args:
            request_id: the request.
        Returns:
            Its block table as a tuple (callers cannot change it); empty if unknown.
        """
        return tuple(self._block_tables.get(request_id, ()))

    def num_live_tokens(self, request_id: str) -> int:
        """Args:
            request_id: the request.
        Returns:
            Its computed tokens as last reported (0 if unknown).
        """
        return self._num_live.get(request_id, 0)

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Args:
            request_id: a request that owns blocks for positions ``[start, end)``.
            start, end: the half-open position range.
        Returns:
            The slot of every position in the range, in order.
        Raises:
            ValueError: the request's blocks do not cover ``[start, end)``.
        """
        table = self._block_tables.get(request_id, [])
        if not 0 <= start <= end <= len(table) * self.block_size:
            raise ValueError(
                f"{request_id!r} owns {len(table)} blocks, not positions [{start}, {end})"
            )
        return slots_for(table, self.block_size, start, end)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` has a block table (possibly empty)."""
        return request_id in self._block_tables

    def reset_prefix_cache(self) -> int:
        """Forget the cached content no request owns (``BlockPool.drop_evictable``) and zero
        the since-start counters (prefix-cache queries and hits, evictions). The engine calls
        it after its warm-up, whose synthetic prompts are nobody's prefix: the pool and its
        figures then start from what served requests do.

        Returns:
            How many cached blocks were dropped.
        """
        dropped = self.pool.drop_evictable()
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.pool.num_evictions = 0
        return dropped

    def stats(self) -> KVCacheStats:
        """Returns:
        A snapshot of occupancy, prefix-cache counters and live slots.
        """
        # Each owner counts a shared block's slots; shared blocks are full (only cached
        # blocks are shared), so the double count is exactly block_size per extra owner.
        live = sum(self._num_live.values()) - self.block_size * self.pool.num_extra_refs
        return KVCacheStats(
            block_size=self.block_size,
            num_blocks=self.pool.num_blocks,
            num_used_blocks=self.pool.num_used,
            num_free_blocks=self.pool.num_free,
            num_evictable_blocks=self.pool.num_evictable,
            num_cached_blocks=self.pool.num_cached,
            num_live_slots=live,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_evictions=self.pool.num_evictions,
        )

    def check_idle(self) -> None:
        """Raise AssertionError unless no request holds blocks and every block is back in
        the pool (``BlockPool.check_idle``): constant time, for each time the engine goes
        idle. ``check_integrity`` is the whole check."""
        assert not self._block_tables, f"blocks held with no request left: {self._block_tables}"
        assert not self._num_live and not self._num_hashed, "counts of requests gone"
        self.pool.check_idle()

    def check_integrity(self) -> None:
        """Raise AssertionError unless: the pool is consistent (free + evictable + used ==
        total, every hashed block mapped once); no request owns a block twice; every used
        block's ref count equals its owners; shared blocks are cached; every block a request
        may still write is private and unhashed; and live slots add up.

        Reads the tables and the pool; changes nothing. Tests call it after every step.
        """
        pool, bs = self.pool, self.block_size
        pool.check_integrity()
        assert not pool.num_cached or self.enable_prefix_caching, "hashes with caching off"
        owners = [0] * pool.num_blocks
        live_per_block = [0] * pool.num_blocks
        for request_id, table in self._block_tables.items():
            assert len(set(table)) == len(table), f"{request_id} owns a block twice"
            assert request_id in self._num_live, f"{request_id} has no live-token count"
            live = self._num_live[request_id]
            assert 0 <= live <= len(table) * bs, f"{request_id}: {live} live tokens"
            assert self._num_hashed[request_id] <= len(table)
            for i, block_id in enumerate(table):
                owners[block_id] += 1
                filled = min(bs, max(0, live - i * bs))
                live_per_block[block_id] = max(live_per_block[block_id], filled)
        # Compared whole at C speed (a GPU's pool holds tens of thousands of blocks); a
        # mismatch walks them to name one.
        if owners != pool.ref_counts():
            for block_id, count in enumerate(owners):
                assert count == pool.ref_count(block_id), (
                    f"block {block_id}: {count} owners, ref count {pool.ref_count(block_id)}"
                )
        for block_id in compress(range(len(owners)), map((1).__lt__, owners)):
            assert pool.cache.hash_of(block_id) is not None, f"shared block {block_id}"
        for request_id, table in self._block_tables.items():
            for block_id in table[self._num_live[request_id] // bs :]:
                assert pool.ref_count(block_id) == 1, (
                    f"{request_id} may write block {block_id}, which is shared"
                )
                assert pool.cache.hash_of(block_id) is None, (
                    f"{request_id} may write block {block_id}, which is cached"
                )
        # The live slots the stats report must equal the slots the tables fill, each block
        # counted once.
        assert self.stats().num_live_slots == sum(live_per_block), "live slots do not add up"
