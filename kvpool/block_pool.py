"""BlockPool: the free list and reference counts of the paged KV cache (pure Python).

Owns: which block ids are free, and how many owners each used block has. It knows nothing
about requests; ``kvpool/manager.py`` maps requests to blocks on top of it.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """A fixed set of ``num_blocks`` blocks, handed out from a FIFO free list.

    NOTE: invariants, checked by ``check_integrity()``:
      - every block id is either on the free list (ref count 0) or used (ref count >= 1);
      - no id appears on the free list twice;
      - ``num_free + num_used == num_blocks``.

    Freed blocks go to the *tail* of the free list and allocations take from the head, so a
    just-freed block is reused last. That keeps block ids predictable in tests and, later,
    lets cached-but-free prefix blocks survive as long as possible.
    """

    def __init__(self, num_blocks: int) -> None:
        """Args:
        num_blocks: total blocks in the pool; ids are ``0 .. num_blocks - 1``.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with at least one owner."""
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        """Owners of ``block_id`` (0 when free)."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """The free list, head (next allocated) first: a copy, for tests and debugging."""
        return list(self._free)

    def allocate(self, num: int) -> list[int]:
        """Take ``num`` blocks off the free list, each with ref count 1.

        Args:
            num: blocks wanted (0 is allowed and takes nothing).
        Returns:
            The block ids, in free-list order.
        Raises:
            NoFreeBlocksError: fewer than ``num`` blocks are free (nothing is taken).
        """
        if num < 0:
            raise ValueError(f"cannot allocate {num} blocks")
        if num > len(self._free):
            raise NoFreeBlocksError(f"asked for {num} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(num)]
        for block_id in ids:
            self._ref_counts[block_id] = 1
        return ids

    def share(self, block_ids: list[int]) -> None:
        """Add one owner to each (used) block: the block is now shared.

        Args:
            block_ids: used blocks; an id may repeat (it gains one owner per occurrence).
        Raises:
            ValueError: an id is out of range or free (nothing changes).
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] < 1:
                raise ValueError(f"cannot share free block {block_id}")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one owner from each block; blocks with no owner left go to the free list.

        Blocks are released in the given order, so callers that free a request's blocks
        tail-first return its last (least shareable) blocks to the list first.

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
            if count == 1:
                self._free.append(block_id)

    def _check_id(self, block_id: int) -> None:
        # A negative id would silently index from the end of the ref-count list.
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def check_integrity(self) -> None:
        """Raise AssertionError if the free list and ref counts disagree."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert free <= set(range(self.num_blocks)), (
            f"free list holds unknown ids {sorted(free - set(range(self.num_blocks)))}"
        )
        assert len(self._ref_counts) == self.num_blocks
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has ref count {count}"
            assert (count == 0) == (block_id in free), (
                f"block {block_id}: ref count {count} but {'' if block_id in free else 'not '}free"
            )
        num_used = sum(1 for count in self._ref_counts if count > 0)
        assert self.num_free + num_used == self.num_blocks, "free + used != total"
