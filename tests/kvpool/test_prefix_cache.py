"""Block hashes, the hash -> block map, and the pool's evictable (LRU) cached blocks.

Exact block ids after every scripted operation, ``check_integrity()`` after each, and every
block free or evictable at the end.
"""

from __future__ import annotations

import pytest

from kvpool.block_pool import BlockPool, NoFreeBlocksError
from kvpool.prefix_cache import ROOT_HASH, PrefixCache, extend_chain, hash_block

BS = 4


def chain_of(tokens: list[int], num_blocks: int | None = None) -> list[bytes]:
    chain: list[bytes] = []
    n = len(tokens) // BS if num_blocks is None else num_blocks
    extend_chain(chain, n, BS, lambda start, end: tokens[start:end])
    return chain


def h(i: int) -> bytes:
    """A distinct stand-in hash per test block."""
    return hash_block(ROOT_HASH, [i] * BS)


def test_hashes_chain_so_equal_hashes_mean_equal_prefixes() -> None:
    a = chain_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = chain_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 99])
    c = chain_of([0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert len(a) == 3 and len(set(a)) == 3
    assert a[:2] == b[:2] and a[2] != b[2]  # diverges in block 2 only
    # A change in block 0 changes every later hash, even where the block's tokens agree.
    assert all(x != y for x, y in zip(a, c, strict=True))
    # The same tokens at another block index hash differently (their parent differs).
    assert chain_of([5, 6, 7, 8])[0] != a[1]
    assert a[0] == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])


def test_extend_chain_only_appends_and_refuses_partial_blocks() -> None:
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    chain = chain_of(tokens, 1)
    first = chain[0]
    extend_chain(chain, 2, BS, lambda start, end: tokens[start:end])
    assert chain[0] is first and len(chain) == 2
    with pytest.raises(AssertionError, match="not full"):
        extend_chain(chain, 3, BS, lambda start, end: tokens[start:end])


def test_prefix_cache_is_a_bijection() -> None:
    cache = PrefixCache()
    cache.insert(h(1), 5)
    cache.insert(h(2), 7)
    assert (cache.get(h(1)), cache.get(h(2)), cache.get(h(3))) == (5, 7, None)
    assert (cache.hash_of(5), cache.hash_of(6)) == (h(1), None)
    with pytest.raises(AssertionError, match="already cached"):
        cache.insert(h(1), 6)
    with pytest.raises(AssertionError, match="already holds"):
        cache.insert(h(3), 5)
    cache.check_integrity(8)
    assert cache.remove(5) == h(1)
    assert cache.get(h(1)) is None and len(cache) == 1
    cache.check_integrity(8)


def test_freed_cached_blocks_become_evictable_the_rest_free() -> None:
    pool = BlockPool(6)
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool.cache_block(0, h(0)) and pool.cache_block(1, h(1))
    pool.check_integrity()
    pool.free([3, 2, 1, 0])  # tail first, as KVCacheManager.free does
    pool.check_integrity()
    assert pool.free_block_ids() == [4, 5, 3, 2]
    assert pool.evictable_block_ids() == [1, 0]  # least recently used first
    assert (pool.num_free, pool.num_evictable, pool.num_used) == (4, 2, 0)
    assert pool.num_available == 6 and pool.num_cached == 2
    assert pool.lookup(h(0)) == 0  # still cached while ownerless


def test_eviction_takes_free_blocks_first_then_lru_evictable_only() -> None:
    pool = BlockPool(6)
    assert pool.allocate(6) == [0, 1, 2, 3, 4, 5]
    for block_id in (0, 1, 2, 3):
        assert pool.cache_block(block_id, h(block_id))
    pool.free([1, 0])  # evictable: 1, 0
    pool.free([4])  # free list: 4
    pool.free([3, 2])  # evictable: 1, 0, 3, 2
    pool.free([5])  # free list: 4, 5
    pool.check_integrity()
    assert pool.evictable_block_ids() == [1, 0, 3, 2]
    # Never-cached blocks go first; cached content survives as long as possible.
    assert pool.allocate(2) == [4, 5]
    assert pool.num_evictions == 0
    pool.check_integrity()
    # Then the least recently freed cached block: its hash is dropped.
    assert pool.allocate(1) == [1]
    assert pool.lookup(h(1)) is None and pool.cache.hash_of(1) is None
    assert pool.evictable_block_ids() == [0, 3, 2]
    pool.check_integrity()
    # A hit revives an evictable block (off the LRU list); freed again, it is the most
    # recently used, so 3 and 2 are now evicted before it.
    pool.share([0])
    assert pool.ref_count(0) == 1 and pool.evictable_block_ids() == [3, 2]
    pool.free([0])
    assert pool.evictable_block_ids() == [3, 2, 0]
    assert pool.allocate(2) == [3, 2]
    assert pool.evictable_block_ids() == [0] and pool.num_evictions == 3
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)  # 1 available: nothing is taken
    assert pool.evictable_block_ids() == [0]
    pool.check_integrity()
    pool.free([4, 5, 1, 3, 2])
    pool.check_integrity()
    assert pool.num_free + pool.num_evictable == pool.num_blocks


def test_shared_blocks_count_extra_refs_and_free_by_owner() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.cache_block(0, h(0))
    pool.share([0, 0])
    assert pool.ref_count(0) == 3 and pool.num_extra_refs == 2
    pool.check_integrity()
    pool.free([0, 1])
    assert pool.ref_count(0) == 2 and pool.num_extra_refs == 1
    assert pool.free_block_ids() == [2, 3, 1] and pool.evictable_block_ids() == []
    pool.free([0, 0])
    assert pool.evictable_block_ids() == [0] and pool.num_extra_refs == 0
    pool.check_integrity()


def test_cache_block_keeps_the_first_copy_of_a_content() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.cache_block(0, h(9))
    # Block 1 holds the same content, computed independently: it is not registered.
    assert not pool.cache_block(1, h(9))
    assert pool.cache.hash_of(1) is None
    pool.free([1, 0])
    assert pool.free_block_ids() == [2, 3, 1] and pool.evictable_block_ids() == [0]
    with pytest.raises(ValueError, match="unowned"):
        pool.cache_block(2, h(3))
    pool.check_integrity()


def test_sharing_a_never_cached_free_block_is_refused() -> None:
    pool = BlockPool(3)
    assert pool.allocate(1) == [0]
    pool.cache_block(0, h(0))
    pool.free([0])
    with pytest.raises(ValueError, match="free block 1"):
        pool.share([0, 1])
    assert pool.evictable_block_ids() == [0]  # the valid evictable id was not revived
    pool.check_integrity()


@pytest.mark.parametrize("corrupt", ["free_hashed", "evictable_unhashed", "both", "map"])
def test_check_integrity_catches_cache_corruption(corrupt: str) -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.cache_block(0, h(0))
    pool.free([1, 0])  # free: 2, 3, 1; evictable: 0
    pool.check_integrity()
    if corrupt == "free_hashed":
        pool.cache._hash_by_block[1] = h(1)
        pool.cache._block_by_hash[h(1)] = 1
        match = "free block 1 still holds a hash"
    elif corrupt == "evictable_unhashed":
        pool.cache.remove(0)
        match = "evictable block 0 holds no hash"
    elif corrupt == "both":
        pool._free.append(0)
        match = "free and evictable"
    else:
        pool.cache._block_by_hash[h(0)] = 2
        match = "not 1:1|does not hold"
    with pytest.raises(AssertionError, match=match):
        pool.check_integrity()
