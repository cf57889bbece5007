"""BlockPool: exact block ids, reference counts and free-list order over scripted sequences."""

from __future__ import annotations

import pytest

from kvpool.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_takes_from_the_head_in_order() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.free_block_ids() == [5]
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert (pool.num_free, pool.num_used) == (1, 5)
    pool.check_integrity()


def test_allocate_zero_takes_nothing() -> None:
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.free_block_ids() == [0, 1]
    pool.check_integrity()


def test_freed_blocks_go_to_the_tail_in_the_given_order() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)  # [0, 1, 2]
    pool.allocate(2)  # [3, 4]
    pool.free(a[::-1])  # tail-first, as KVCacheManager.free does
    pool.check_integrity()
    assert pool.free_block_ids() == [5, 2, 1, 0]
    # The block freed longest ago (5 was never used) comes out first.
    assert pool.allocate(2) == [5, 2]
    assert pool.free_block_ids() == [1, 0]
    pool.check_integrity()


def test_exhaustion_raises_and_takes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.free_block_ids() == [3]
    assert pool.num_used == 3
    pool.check_integrity()
    assert pool.allocate(1) == [3]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_integrity()


def test_share_and_free_count_owners() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)  # [0, 1]
    pool.share(blocks)
    pool.share([0])
    assert [pool.ref_count(b) for b in range(4)] == [3, 2, 0, 0]
    pool.check_integrity()

    pool.free([1, 0])
    assert [pool.ref_count(b) for b in range(4)] == [2, 1, 0, 0]
    assert pool.free_block_ids() == [2, 3]  # still owned: nothing released
    pool.check_integrity()

    pool.free([1])
    assert pool.ref_count(1) == 0
    assert pool.free_block_ids() == [2, 3, 1]
    pool.check_integrity()

    pool.free([0, 0])  # one id twice: two owners dropped
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.num_used == 0
    pool.check_integrity()


def test_share_of_a_free_block_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(1)  # [0]
    with pytest.raises(ValueError, match="free block 1"):
        pool.share([0, 1])
    assert pool.ref_count(0) == 1  # the valid id before the bad one was not shared either
    pool.check_integrity()


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(2)  # [0, 1]
    pool.free([1])
    with pytest.raises(ValueError, match="double free of block 1"):
        pool.free([1])
    # A list that would free block 0 and then double-free it is refused as a whole.
    with pytest.raises(ValueError, match="double free of block 0"):
        pool.free([0, 0])
    assert pool.ref_count(0) == 1
    assert pool.free_block_ids() == [2, 3, 1]
    pool.check_integrity()


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_out_of_range_ids_are_refused(bad: int) -> None:
    pool = BlockPool(4)
    pool.allocate(4)
    # -1 must not alias the last block.
    with pytest.raises(ValueError, match="out of range"):
        pool.free([bad])
    with pytest.raises(ValueError, match="out of range"):
        pool.share([bad])
    assert pool.num_used == 4
    pool.check_integrity()


def test_invalid_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(2).allocate(-1)


def test_check_integrity_catches_a_block_both_free_and_used() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._free.append(0)  # corrupt: block 0 is owned but also on the free list
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_a_leaked_block() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._ref_counts[0] = 0  # corrupt: nobody owns block 0 but it is not free
    with pytest.raises(AssertionError, match="block 0"):
        pool.check_integrity()


def test_check_integrity_catches_a_duplicate_on_the_free_list() -> None:
    pool = BlockPool(3)
    pool._free.append(2)
    with pytest.raises(AssertionError, match="twice"):
        pool.check_integrity()


def test_check_integrity_catches_an_unknown_id_on_the_free_list() -> None:
    pool = BlockPool(3)
    pool._free.append(7)
    with pytest.raises(AssertionError, match="unknown"):
        pool.check_integrity()


def test_check_integrity_catches_a_negative_ref_count() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._ref_counts[0] = -1
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_idle_holds_once_every_block_is_back() -> None:
    pool = BlockPool(4)
    pool.check_idle()
    ids = pool.allocate(2)
    pool.cache_block(ids[0], b"h0")
    with pytest.raises(AssertionError, match="2 free \\+ 0 evictable blocks with no request"):
        pool.check_idle()  # owned blocks: what a request gone without freeing them leaves
    pool.free(ids)
    pool.check_idle()  # one free again, one evictable with its hash
    assert (pool.num_free, pool.num_evictable) == (3, 1)


def test_check_idle_catches_a_double_free_and_a_stray_hash() -> None:
    pool = BlockPool(3)
    pool._free.append(1)  # corrupt: block 1 freed twice
    with pytest.raises(AssertionError, match="leaked or was freed twice"):
        pool.check_idle()
    pool._free.pop()
    pool.cache._hash_by_block[2] = b"h"  # corrupt: a free block still mapped under a hash
    pool.cache._block_by_hash[b"h"] = 2
    with pytest.raises(AssertionError, match="1 hashed blocks but 0 evictable"):
        pool.check_idle()


def test_the_whole_check_names_the_block_a_fast_comparison_found_wrong() -> None:
    """check_integrity compares the pool whole; what it raises still names the block."""
    pool = BlockPool(64)
    ids = pool.allocate(40)
    pool.cache_block(ids[5], b"h5")
    pool.free(ids[:10])
    pool.check_integrity()
    pool._ref_counts[37] = 0  # corrupt: owned block 37 lost its owner, yet is not free
    with pytest.raises(AssertionError, match="block 37: ref count 0 but not free"):
        pool.check_integrity()
    pool._ref_counts[37] = 1
    pool.cache._hash_by_block[3] = b"x"  # corrupt: a free block holds a hash
    pool.cache._block_by_hash[b"x"] = 3
    with pytest.raises(AssertionError, match="free block 3 still holds a hash"):
        pool.check_integrity()
