"""BlockPool: the free list, the evictable cached blocks and reference counts (pure Python).

Owns: which block ids are free, which ownerless blocks still hold cached prefix content
(evictable, in LRU order), how many owners each used block has, and the hash <-> block map
(``PrefixCache``). It knows nothing about requests; ``kvpool/manager.py`` maps requests to
blocks on top of it.

Every block is in exactly one of three states::

    free       ref 0, no hash      on the FIFO free list; allocated first
    evictable  ref 0, hash         on the LRU list; reusable by a cache hit, or evicted (hash
                                   dropped) and allocated once the free list is empty
    used       ref >= 1            owned by one or more requests (shared if >= 2); may hold
                                   a hash
"""

from __future__ import annotations

from collections import OrderedDict, deque

from kvpool.prefix_cache import BlockHash, PrefixCache


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free or evictable."""


class BlockPool:
    """A fixed set of ``num_blocks`` blocks, handed out from a FIFO free list, then from the
    least recently used evictable cached blocks.

    NOTE: invariants, checked by ``check_integrity()``:
      - every block id is exactly one of free (ref 0, no hash), evictable (ref 0, hash) or
        used (ref >= 1);
      - ``num_free + num_evictable + num_used == num_blocks``;
      - every hashed block is in the hash map exactly once.

    Freed blocks go to the *tail* of the free list (or, if they hold a hash, to the
    most-recently-used end of the evictable list) and allocations take from the head, so a
    just-freed block is reused last. That keeps block ids predictable in tests and lets cached
    prefix blocks survive as long as possible: a cached block is evicted only when no
    never-cached block is left.
    """

    def __init__(self, num_blocks: int) -> None:
        """Args:
        num_blocks: total blocks in the pool; ids are ``0 .. num_blocks - 1``.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Ownerless cached blocks, least recently freed first (an ordered set).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts: list[int] = [0] * num_blocks
        # Sum over blocks of max(0, ref - 1): slots counted twice when requests' live tokens
        # are summed (kvpool KV-waste accounting). Kept incrementally: O(1) per change.
        self._num_extra_refs = 0
        self.cache = PrefixCache()
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks on the free list (never cached, or evicted)."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Ownerless blocks that still hold cached content."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks with at least one owner."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks holding a prefix hash (used or evictable)."""
        return len(self.cache)

    @property
    def num_extra_refs(self) -> int:
        """Owners beyond the first, summed over blocks (0 when nothing is shared)."""
        return self._num_extra_refs

    def ref_count(self, block_id: int) -> int:
        """Owners of ``block_id`` (0 when free or evictable)."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def ref_counts(self) -> list[int]:
        """Every block's owners, by block id: a copy."""
        return self._ref_counts.copy()

    def free_block_ids(self) -> list[int]:
        """The free list, head (next allocated) first: a copy, for tests and debugging."""
        return list(self._free)

    def evictable_block_ids(self) -> list[int]:
        """The evictable blocks, least recently used (next evicted) first: a copy."""
        return list(self._evictable)

    def allocate(self, num: int) -> list[int]:
        """Take ``num`` blocks, each with ref count 1: from the free list first, then by
        evicting the least recently used evictable blocks (their hashes are dropped).

        Args:
            num: blocks wanted (0 is allowed and takes nothing).
        Returns:
            The block ids, in the order taken.
        Raises:
            NoFreeBlocksError: fewer than ``num`` blocks are free or evictable (nothing is
                taken).
        """
        if num < 0:
            raise ValueError(f"cannot allocate {num} blocks")
        if num > self.num_available:
            raise NoFreeBlocksError(f"asked for {num} blocks, {self.num_available} available")
        ids = []
        for _ in range(num):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self.cache.remove(block_id)
                self.num_evictions += 1
            self._ref_counts[block_id] = 1
            ids.append(block_id)
        return ids

    def share(self, block_ids: list[int]) -> None:
        """Add one owner to each block: a used block becomes shared, and an evictable block
        (a prefix-cache hit on ownerless content) is taken off the LRU list and used again.

        Args:
            block_ids: used or evictable blocks; an id may repeat (one owner per occurrence).
        Raises:
            ValueError: an id is out of range or on the free list (nothing changes).
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] < 1 and block_id not in self._evictable:
                raise ValueError(f"cannot share free block {block_id}")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            else:
                self._num_extra_refs += 1
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one owner from each block. A block left with no owner goes to the free list,
        or, if it holds a hash, to the most-recently-used end of the evictable list.

        Blocks are released in the given order, so callers that free a request's blocks
        tail-first return its last (least shareable) blocks first: a prefix's tail is then
        evicted before its head, which more requests share.

        Args:
            block_ids: used blocks; an id may repeat (it loses one owner per occurrence).
        Raises:
            ValueError: an id is out of range, or would drop below zero owners (a double
                free). Validation happens before any change, so a bad call changes nothing.
        """
        drops: dict[int, int] = {}
        for block_id in block_ids:
            self._check_id(block_id)
            drops[block_id] = drops.get(block_id, 0) + 1
        for block_id, num in drops.items():
            if self._ref_counts[block_id] < num:
                raise ValueError(f"double free of block {block_id}")
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            self._ref_counts[block_id] = count - 1
            if count > 1:
                self._num_extra_refs -= 1
            elif self.cache.hash_of(block_id) is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    # ---- prefix cache -------------------------------------------------------------------

    def drop_evictable(self) -> int:
        """Forget the content of every ownerless cached block: each leaves the evictable
        list for the tail of the free list (least recently used first) without its hash.
        Not counted as evictions: no allocation asked for the blocks. Used blocks keep
        their hashes.

        Returns:
            How many blocks were dropped.
        """
        dropped = list(self._evictable)
        for block_id in dropped:
            self.cache.remove(block_id)
            self._free.append(block_id)
        self._evictable.clear()
        return len(dropped)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """Args:
            block_hash: a chained block hash.
        Returns:
            The used or evictable block holding that content, or None.
        """
        return self.cache.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a used, full, computed block under its content hash.

        Args:
            block_id: a used block holding no hash.
            block_hash: its chained content hash.
        Returns:
            False (nothing changes) if another block already holds ``block_hash``: two
            requests computed the same content, and the first one stays the cached copy.
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] < 1:
            raise ValueError(f"cannot cache unowned block {block_id}")
        if self.cache.get(block_hash) is not None:
            return False
        self.cache.insert(block_hash, block_id)
        return True

    def _check_id(self, block_id: int) -> None:
        # A negative id would silently index from the end of the ref-count list.
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def check_integrity(self) -> None:
        """Raise AssertionError if the free list, evictable list, ref counts and hash map
        disagree.

        The whole-pool checks run at C speed (set algebra, ``list.count``, ``min``, ``sum``):
        tests run this after every step and the server under ``--check-integrity``, and a
        GPU's pool holds tens of thousands of blocks, over which a per-block Python loop
        takes tens of milliseconds holding the GIL. Only a failure walks the blocks, to name
        the first one that is wrong. (Going idle, the engine runs ``check_idle``.)
        """
        n, counts = self.num_blocks, self._ref_counts
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert _in_range(free, n), f"free list holds unknown ids {_outside(free, n)}"
        assert _in_range(evictable, n), f"unknown evictable ids {_outside(evictable, n)}"
        assert not free & evictable, f"blocks {sorted(free & evictable)} free and evictable"
        assert len(counts) == n
        self.cache.check_integrity(n)
        hashed = self.cache.hashed_block_ids()
        num_idle = len(free) + len(evictable)
        # Every idle block has no owner and as many blocks have none as are idle, so the
        # blocks without an owner are exactly the idle ones (free + evictable + used ==
        # total); no count is negative; free blocks hold no hash and evictable ones do.
        consistent = (
            min(counts) >= 0
            and counts.count(0) == num_idle
            and not any(map(counts.__getitem__, free))
            and not any(map(counts.__getitem__, evictable))
            and hashed.isdisjoint(free)
            and all(map(hashed.__contains__, evictable))
        )
        if not consistent:
            self._check_each_block(free, evictable)
            raise AssertionError("ref counts, free and evictable lists disagree")
        extra = sum(counts) - (n - num_idle)  # each used block's owners beyond its first
        assert extra == self._num_extra_refs, f"extra refs {self._num_extra_refs} != {extra}"

    def check_idle(self) -> None:
        """Raise AssertionError unless every block is back: free or evictable, none owned,
        and the evictable ones exactly the hashed ones. What must hold once no request is
        left, in constant time (the lists' and the hash map's sizes): the engine checks it
        each time it goes idle, when the next request may already be waiting. A block
        leaked (owned by no request) or freed twice changes the sum. ``check_integrity``
        checks every block."""
        back = self.num_free + self.num_evictable
        assert back == self.num_blocks, (
            f"{self.num_free} free + {self.num_evictable} evictable blocks with no request "
            f"left, of {self.num_blocks}: a block leaked or was freed twice"
        )
        assert self._num_extra_refs == 0, f"{self._num_extra_refs} extra refs with no owner"
        assert self.num_cached == self.num_evictable, (
            f"{self.num_cached} hashed blocks but {self.num_evictable} evictable, none owned"
        )

    def _check_each_block(self, free: set[int], evictable: set[int]) -> None:
        """The per-block form of ``check_integrity``'s state checks, raising on the first
        block found wrong (what its message names)."""
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has ref count {count}"
            idle = block_id in free or block_id in evictable
            assert (count == 0) == idle, (
                f"block {block_id}: ref count {count} but {'' if idle else 'not '}free"
            )
            hashed = self.cache.hash_of(block_id) is not None
            if block_id in free:
                assert not hashed, f"free block {block_id} still holds a hash"
            if block_id in evictable:
                assert hashed, f"evictable block {block_id} holds no hash"


def _in_range(ids: set[int], n: int) -> bool:
    return not ids or (min(ids) >= 0 and max(ids) < n)


def _outside(ids: set[int], n: int) -> list[int]:
    return sorted(i for i in ids if not 0 <= i < n)
