"""KVCacheManager: block tables across block boundaries, slot mapping, exhaustion, free order.

Every scripted operation is followed by ``check_integrity()``.
"""

from __future__ import annotations

import pytest

from kvpool.manager import KVCacheManager, slots_for

BS = 16


def make(num_blocks: int = 8) -> KVCacheManager:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS)
    kv.check_integrity()
    return kv


@pytest.mark.parametrize(
    ("num_tokens", "num_blocks"), [(1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)]
)
def test_blocks_for_token_counts_at_boundaries(num_tokens: int, num_blocks: int) -> None:
    kv = make()
    assert kv.num_blocks_for(num_tokens) == num_blocks
    assert kv.allocate_slots("a", num_tokens) == list(range(num_blocks))
    assert kv.block_ids("a") == tuple(range(num_blocks))
    assert kv.num_free_blocks == 8 - num_blocks
    kv.check_integrity()


def test_growing_one_token_at_a_time_crosses_boundaries_exactly() -> None:
    kv = make()
    assert kv.allocate_slots("a", 15) == [0]
    kv.check_integrity()
    assert kv.allocate_slots("a", 16) == []  # slot 15 of block 0: no new block
    kv.check_integrity()
    assert kv.allocate_slots("a", 17) == [1]  # position 16 opens block 1
    kv.check_integrity()
    assert kv.allocate_slots("a", 17) == []  # asking again is idempotent
    assert kv.allocate_slots("a", 3) == []  # asking for less never shrinks
    assert kv.block_ids("a") == (0, 1)
    assert (kv.num_used_blocks, kv.num_free_blocks) == (2, 6)
    assert kv.pool.ref_count(0) == kv.pool.ref_count(1) == 1
    kv.check_integrity()


def test_interleaved_requests_get_interleaved_blocks() -> None:
    kv = make()
    assert kv.allocate_slots("a", 16) == [0]
    assert kv.allocate_slots("b", 20) == [1, 2]
    assert kv.allocate_slots("a", 17) == [3]
    assert kv.allocate_slots("c", 1) == [4]
    assert kv.allocate_slots("b", 33) == [5]
    kv.check_integrity()
    assert kv.block_ids("a") == (0, 3)
    assert kv.block_ids("b") == (1, 2, 5)
    assert kv.block_ids("c") == (4,)
    assert kv.usage == 6 / 8


def test_free_releases_tail_first_and_later_allocations_reuse_in_that_order() -> None:
    kv = make(8)
    kv.allocate_slots("a", 48)  # [0, 1, 2]
    kv.allocate_slots("b", 32)  # [3, 4]
    kv.free("a")
    kv.check_integrity()
    assert not kv.has_request("a")
    assert kv.block_ids("a") == ()
    assert kv.pool.free_block_ids() == [5, 6, 7, 2, 1, 0]
    kv.free("b")
    kv.check_integrity()
    assert kv.pool.free_block_ids() == [5, 6, 7, 2, 1, 0, 4, 3]
    assert kv.allocate_slots("c", 80) == [5, 6, 7, 2, 1]
    kv.check_integrity()
    kv.free("c")
    kv.free("c")  # unknown by now: ignored
    kv.free("never-seen")
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    kv = make(4)
    assert kv.allocate_slots("a", 40) == [0, 1, 2]
    before = (kv.block_ids("a"), kv.pool.free_block_ids())

    assert kv.allocate_slots("a", 65) is None  # needs 2 more, 1 free
    assert kv.allocate_slots("b", 17) is None  # needs 2, 1 free
    assert (kv.block_ids("a"), kv.pool.free_block_ids()) == before
    assert not kv.has_request("b")  # a refused request gets no (empty) table either
    kv.check_integrity()

    assert kv.allocate_slots("b", 16) == [3]  # exactly the last block still works
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots("a", 48) == []  # no growth needed: fine at zero free
    assert kv.allocate_slots("a", 49) is None
    kv.check_integrity()


def test_num_new_blocks_needed_and_capacity() -> None:
    kv = make(4)
    assert kv.num_new_blocks_needed("a", 17) == 2
    kv.allocate_slots("a", 17)
    assert kv.num_new_blocks_needed("a", 32) == 0
    assert kv.num_new_blocks_needed("a", 33) == 1
    assert kv.fits_in_empty_pool(64)
    assert not kv.fits_in_empty_pool(65)


def test_slot_mapping_values() -> None:
    kv = make()
    kv.allocate_slots("x", 16)  # [0]
    kv.allocate_slots("a", 20)  # [1, 2]
    kv.allocate_slots("x", 17)  # [0, 3]
    # a: positions 0..15 in block 1 (slots 16..31), positions 16..19 in block 2 (32..35).
    assert kv.slot_mapping("a", 0, 3) == [16, 17, 18]
    assert kv.slot_mapping("a", 14, 18) == [30, 31, 32, 33]
    assert kv.slot_mapping("a", 19, 20) == [35]
    # x: position 15 is the last slot of block 0, position 16 the first of block 3.
    assert kv.slot_mapping("x", 15, 17) == [15, 48]
    assert kv.slot_mapping("x", 5, 5) == []
    assert slots_for([7, 2], 4, 2, 6) == [30, 31, 8, 9]


def test_slot_mapping_refuses_positions_without_blocks() -> None:
    kv = make()
    kv.allocate_slots("a", 16)
    with pytest.raises(ValueError, match="owns 1 blocks"):
        kv.slot_mapping("a", 10, 17)
    with pytest.raises(ValueError):
        kv.slot_mapping("nobody", 0, 1)


def test_check_integrity_catches_a_block_owned_twice() -> None:
    kv = make()
    kv.allocate_slots("a", 16)
    kv.allocate_slots("b", 16)
    kv._block_tables["b"].append(0)  # corrupt: b claims a's block without a ref
    with pytest.raises(AssertionError, match="block 0: 2 owners, ref count 1"):
        kv.check_integrity()


def test_check_integrity_catches_a_table_with_a_repeated_block() -> None:
    kv = make()
    kv.allocate_slots("a", 16)
    kv._block_tables["a"].append(0)
    with pytest.raises(AssertionError, match="owns a block twice"):
        kv.check_integrity()


def test_check_integrity_catches_an_orphaned_block() -> None:
    kv = make()
    kv.allocate_slots("a", 32)
    del kv._block_tables["a"]  # corrupt: the blocks are used but nobody owns them
    with pytest.raises(AssertionError, match="0 owners"):
        kv.check_integrity()


def test_check_integrity_counts_shared_blocks() -> None:
    kv = make()
    kv.allocate_slots("a", 16)  # [0]
    kv.pool.share([0])
    with pytest.raises(AssertionError, match="1 owners, ref count 2"):
        kv.check_integrity()  # a ref without an owning table is a leak
    # A second table owning it makes the counts agree...
    kv._block_tables["b"] = [0]
    kv._num_live["b"], kv._num_hashed["b"] = 16, 0
    # ...but only cached (full, computed, immutable) blocks may be shared.
    with pytest.raises(AssertionError, match="shared block 0"):
        kv.check_integrity()
    kv.free("a")
    assert kv.pool.ref_count(0) == 1
    assert kv.num_used_blocks == 1
    kv.check_integrity()
    kv.free("b")
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_check_idle_refuses_a_table_left_behind() -> None:
    kv = make()
    kv.check_idle()
    kv.allocate_slots("a", 20)
    with pytest.raises(AssertionError, match="blocks held with no request left"):
        kv.check_idle()
    kv.free("a")
    kv.check_idle()
    kv.pool.allocate(1)  # corrupt: a block owned outside any table
    with pytest.raises(AssertionError, match="a block leaked"):
        kv.check_idle()
