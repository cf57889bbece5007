"""KVCacheManager: which blocks each request owns, and the slots its tokens live in.

Owns: the request -> block ids map (a request's *block table*). The scheduler asks it for
room (``allocate_slots``) and gives room back (``free``); it sees block ids only through the
values returned here and never changes them.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.block_pool import BlockPool


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
    """Block tables over a ``BlockPool``.

    A request with ``n`` tokens in the cache owns ``ceil(n / block_size)`` blocks; token at
    position ``p`` lives in slot ``block_table[p // block_size] * block_size + p % block_size``::

        positions  0 ........ 15 | 16 ....... 31 | 32 .. 37
        blocks     block_table[0] | block_table[1] | block_table[2] (6 of 16 slots used)
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        """
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list."""
        return self.pool.num_free

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

    # ---- allocation -----------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow ``request_id``'s block table so it holds ``num_tokens`` tokens in total.

        Args:
            request_id: the request (a new id starts an empty table).
            num_tokens: tokens the request will have in the cache after this step
                (computed so far + scheduled now), or more to reserve ahead.
        Returns:
            The newly allocated block ids (possibly empty), or ``None`` if the pool has too
            few free blocks, in which case nothing changes.
        """
        need = self.num_new_blocks_needed(request_id, num_tokens)
        if need > self.pool.num_free:
            return None
        new_ids = self.pool.allocate(need)
        self._block_tables.setdefault(request_id, []).extend(new_ids)
        return new_ids

    def free(self, request_id: str) -> None:
        """Return all of ``request_id``'s blocks to the pool, tail first, and forget it.

        Args:
            request_id: the request; an unknown id is ignored, so freeing twice is safe at
                this level (the pool itself raises on a double free of a block).
        """
        block_ids = self._block_tables.pop(request_id, None)
        if block_ids:
            self.pool.free(block_ids[::-1])

    # ---- views ----------------------------------------------------------------------------

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """Args:
            request_id: the request.
        Returns:
            Its block table as a tuple (callers cannot change it); empty if unknown.
        """
        return tuple(self._block_tables.get(request_id, ()))

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

    def check_integrity(self) -> None:
        """Raise AssertionError unless every used block's ref count equals its owners."""
        self.pool.check_integrity()
        owners = [0] * self.pool.num_blocks
        for request_id, table in self._block_tables.items():
            assert len(set(table)) == len(table), f"{request_id} owns a block twice"
            for block_id in table:
                owners[block_id] += 1
        for block_id, count in enumerate(owners):
            assert count == self.pool.ref_count(block_id), (
                f"block {block_id}: {count} owners, ref count {self.pool.ref_count(block_id)}"
            )
