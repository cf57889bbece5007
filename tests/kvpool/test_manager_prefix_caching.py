"""KVCacheManager with prefix caching: sharing, divergence, copy-on-write, LRU eviction,
preemption-style frees and KV-waste accounting, with exact block ids.

``check_integrity()`` runs after every operation, and every scenario ends with every block
free or evictable.
"""

from __future__ import annotations

import pytest

from kvpool.manager import CachedPrefix, KVCacheManager

BS = 16


class Seq:
    """A request's token list, as the scheduler would hand it to kvpool."""

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id = request_id
        self.tokens = tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def make(num_blocks: int = 10) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    kv.check_integrity()
    return kv


def admit(kv: KVCacheManager, seq: Seq, num_tokens: int | None = None) -> CachedPrefix:
    """Look ``seq`` up and allocate room for all its tokens (what the scheduler does)."""
    cached = kv.get_cached_prefix(seq.request_id, len(seq.tokens), seq.token_ids)
    total = len(seq.tokens) if num_tokens is None else num_tokens
    assert kv.allocate_slots(seq.request_id, total, cached) is not None
    kv.check_integrity()
    return cached


def compute(kv: KVCacheManager, seq: Seq, num_computed: int | None = None) -> None:
    """The step ran: ``num_computed`` tokens are in the cache (default: all of them)."""
    n = len(seq.tokens) if num_computed is None else num_computed
    kv.commit_computed(seq.request_id, n, seq.token_ids)
    kv.check_integrity()


def free(kv: KVCacheManager, seq: Seq, **kwargs: bool) -> None:
    kv.free(seq.request_id, **kwargs)
    kv.check_integrity()


def all_idle(kv: KVCacheManager) -> bool:
    return kv.pool.num_free + kv.pool.num_evictable == kv.num_blocks


PREFIX = list(range(100, 148))  # 3 full blocks


def test_common_three_block_prefix_is_shared_with_ref_count_two() -> None:
    kv = make()
    a = Seq("a", PREFIX + [1] * 5)  # 53 tokens: blocks 0-2 full, block 3 partial
    b = Seq("b", PREFIX + [2] * 7)
    assert admit(kv, a).block_ids == ()
    assert kv.block_ids("a") == (0, 1, 2, 3)
    compute(kv, a)
    assert kv.pool.cache.cached_block_ids() == [0, 1, 2]  # full blocks only

    cached = admit(kv, b)
    assert cached.block_ids == (0, 1, 2)
    assert (cached.num_cached_tokens, cached.num_computed_tokens) == (48, 48)
    assert kv.block_ids("b") == (0, 1, 2, 4)  # the 7 tokens after the prefix: its own block
    assert [kv.pool.ref_count(i) for i in range(5)] == [2, 2, 2, 1, 1]
    assert kv.num_live_tokens("b") == 48
    assert kv.take_blocks_to_copy() == []
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (53 + 55, 48)

    compute(kv, b)
    free(kv, a)
    # a's partial block is freed; the shared blocks stay with b.
    assert [kv.pool.ref_count(i) for i in range(5)] == [1, 1, 1, 0, 1]
    assert kv.pool.free_block_ids()[-1] == 3
    free(kv, b)
    assert kv.pool.evictable_block_ids() == [2, 1, 0]  # tail first: the head goes last
    assert all_idle(kv)


def test_diverging_inside_a_block_gets_its_own_block() -> None:
    kv = make()
    a = Seq("a", PREFIX + [1] * 5)
    admit(kv, a)
    compute(kv, a)
    # Same first 40 tokens, then different: block 2 (positions 32-47) differs at 40.
    b = Seq("b", PREFIX[:40] + [7] * 12)
    cached = admit(kv, b)
    assert cached.block_ids == (0, 1) and cached.num_computed_tokens == 32
    assert kv.block_ids("b") == (0, 1, 4, 5)
    assert kv.pool.ref_count(2) == 1  # a's block 2 is not shared
    compute(kv, b)
    # b's block 2 is cached too, under its own hash: both versions are now hits.
    assert kv.pool.cache.hash_of(4) is not None
    assert kv.pool.cache.hash_of(4) != kv.pool.cache.hash_of(2)
    free(kv, b)
    free(kv, a)
    assert all_idle(kv)


def test_fully_cached_sequence_copies_its_last_block_on_write() -> None:
    kv = make()
    a = Seq("a", PREFIX + [1] * 5)
    admit(kv, a)
    compute(kv, a)
    # Every token of b is cached; its last token must be recomputed for its logits, and it
    # lives in block 2, which a owns too: b writes into a private copy.
    b = Seq("b", list(PREFIX))
    cached = admit(kv, b)
    assert cached.block_ids == (0, 1, 2) and cached.copies_last_block
    assert (cached.num_cached_tokens, cached.num_computed_tokens) == (48, 47)
    assert kv.block_ids("b") == (0, 1, 4)
    assert kv.take_blocks_to_copy() == [(2, 4)]
    assert kv.take_blocks_to_copy() == []  # handed over once
    assert [kv.pool.ref_count(i) for i in range(5)] == [2, 2, 1, 1, 1]
    compute(kv, b)
    # The copy holds the same content as block 2, which stays the cached one.
    assert kv.pool.cache.hash_of(4) is None
    free(kv, a)
    free(kv, b)
    assert kv.pool.free_block_ids()[-2:] == [3, 4]
    assert kv.pool.evictable_block_ids() == [2, 1, 0]
    assert all_idle(kv)


def test_copy_on_write_source_that_was_evictable_returns_to_the_lru_tail() -> None:
    kv = make(6)
    a = Seq("a", list(PREFIX))
    admit(kv, a)
    compute(kv, a)
    free(kv, a)
    assert kv.pool.evictable_block_ids() == [2, 1, 0]
    b = Seq("b", list(PREFIX))
    admit(kv, b)
    assert kv.block_ids("b") == (0, 1, 3)
    assert kv.take_blocks_to_copy() == [(2, 3)]
    assert kv.pool.evictable_block_ids() == [2]  # revived, copied, released
    compute(kv, b)
    free(kv, b)
    assert all_idle(kv)


def test_eviction_is_lru_over_evictable_blocks_only() -> None:
    kv = make(8)
    x, y = Seq("x", [1] * 32), Seq("y", [2] * 32)
    admit(kv, x)  # [0, 1]
    compute(kv, x)
    admit(kv, y)  # [2, 3]
    compute(kv, y)
    free(kv, x)
    free(kv, y)
    assert kv.pool.evictable_block_ids() == [1, 0, 3, 2]
    assert kv.pool.free_block_ids() == [4, 5, 6, 7]
    # 6 blocks without a hit: the 4 never-cached blocks first, then x's tail and head.
    z = Seq("z", [3] * 96)
    admit(kv, z)
    assert kv.block_ids("z") == (4, 5, 6, 7, 1, 0)
    assert kv.pool.evictable_block_ids() == [3, 2]
    assert kv.pool.num_evictions == 2
    # x is gone from the cache, y is still a full hit (with its last block copied).
    assert kv.get_cached_prefix("x2", 32, Seq("x2", [1] * 32).token_ids).block_ids == ()
    assert kv.get_cached_prefix("y2", 32, Seq("y2", [2] * 32).token_ids).block_ids == (2, 3)
    free(kv, z)
    assert all_idle(kv)


def test_a_hit_is_not_evicted_by_its_own_allocation() -> None:
    kv = make(4)
    a = Seq("a", list(PREFIX))  # blocks 0-2
    admit(kv, a)
    compute(kv, a)
    free(kv, a)
    assert kv.pool.evictable_block_ids() == [2, 1, 0] and kv.pool.free_block_ids() == [3]
    # b hits blocks 0-1 and needs 2 more: block 3, then evicting 2 (never its own hits).
    b = Seq("b", PREFIX[:32] + [9] * 20)
    cached = admit(kv, b)
    assert cached.block_ids == (0, 1)
    assert kv.block_ids("b") == (0, 1, 3, 2)
    assert kv.pool.evictable_block_ids() == []
    # Nothing is left for the next request: it is refused and nothing changes.
    c = Seq("c", [5] * 20)
    assert kv.allocate_slots("c", 20, kv.get_cached_prefix("c", 20, c.token_ids)) is None
    assert not kv.has_request("c")
    kv.check_integrity()
    free(kv, b)
    assert all_idle(kv)


def test_revived_hits_count_against_free_space() -> None:
    kv = make(4)
    a = Seq("a", list(PREFIX))
    admit(kv, a)
    compute(kv, a)
    free(kv, a)  # 3 evictable + 1 free = 4 available
    # 3 hits to revive + 2 new blocks = 5 > 4: refused, and nothing changes.
    b = Seq("b", PREFIX + [1] * 20)
    cached = kv.get_cached_prefix("b", 68, b.token_ids)
    assert cached.block_ids == (0, 1, 2)
    before = (kv.pool.evictable_block_ids(), kv.pool.free_block_ids())
    assert kv.allocate_slots("b", 68, cached) is None
    assert (kv.pool.evictable_block_ids(), kv.pool.free_block_ids()) == before
    assert kv.prefix_cache_queries == 48  # only a's admission was counted
    kv.check_integrity()
    assert all_idle(kv)


def test_preempted_request_finds_its_own_blocks_again() -> None:
    kv = make()
    a = Seq("a", PREFIX + [1] * 10)  # 58 tokens
    admit(kv, a)
    compute(kv, a)
    a.tokens += [4] * 8  # decoded 8 more: positions 58-65, block 4 opens at 64
    assert kv.allocate_slots("a", 66) == [4]
    compute(kv, a, 65)  # the last sampled token is not computed yet
    assert kv.pool.cache.cached_block_ids() == [0, 1, 2, 3]
    free(kv, a, forget=False)  # preemption keeps the hash chain
    assert kv.pool.evictable_block_ids() == [3, 2, 1, 0]
    cached = admit(kv, a)
    assert cached.block_ids == (0, 1, 2, 3) and cached.num_computed_tokens == 64
    assert kv.block_ids("a") == (0, 1, 2, 3, 5)
    free(kv, a)
    assert all_idle(kv)


def test_blocks_are_registered_once_full_and_computed() -> None:
    kv = make()
    a = Seq("a", [7] * 40)
    admit(kv, a)
    compute(kv, a, 20)  # a chunk: block 0 full, block 1 partial
    assert kv.pool.cache.cached_block_ids() == [0]
    b = Seq("b", [7] * 40)
    assert kv.get_cached_prefix("b", 40, b.token_ids).block_ids == (0,)
    assert kv.new_block_hashes("a", 20, 40, a.token_ids) == [
        kv.get_cached_prefix("b", 40, b.token_ids).next_block_hash
    ]
    compute(kv, a, 40)
    assert kv.pool.cache.cached_block_ids() == [0, 1]
    assert kv.new_block_hashes("a", 40, 41, a.token_ids) == []
    free(kv, a)
    assert all_idle(kv)


def test_same_content_computed_twice_is_cached_once() -> None:
    kv = make()
    a, b = Seq("a", [3] * 20), Seq("b", [3] * 20)
    admit(kv, a)  # [0, 1]
    admit(kv, b)  # [2, 3]: nothing cached yet
    compute(kv, a)
    compute(kv, b)
    assert kv.pool.cache.cached_block_ids() == [0]
    free(kv, b)
    free(kv, a)
    assert kv.pool.free_block_ids()[-3:] == [3, 2, 1]  # b's copy is recycled as uncached
    assert kv.pool.evictable_block_ids() == [0]
    assert all_idle(kv)


def test_kv_waste_counts_shared_slots_once() -> None:
    kv = make()
    a = Seq("a", PREFIX + [1] * 5)  # 53 tokens in 4 blocks
    admit(kv, a)
    compute(kv, a)
    stats = kv.stats()
    assert (stats.num_allocated_slots, stats.num_live_slots) == (64, 53)
    assert stats.kv_waste_fraction == pytest.approx(11 / 64)
    b = Seq("b", PREFIX + [2] * 7)  # shares 3 blocks, owns 1 more
    admit(kv, b)
    assert kv.stats().num_live_slots == 53  # b's 7 new tokens are not computed yet
    compute(kv, b)
    stats = kv.stats()
    assert (stats.num_used_blocks, stats.num_allocated_slots) == (5, 80)
    assert stats.num_live_slots == 48 + 5 + 7
    assert stats.kv_waste_fraction == pytest.approx(20 / 80)
    assert (stats.num_cached_blocks, stats.num_evictable_blocks) == (3, 0)
    assert stats.prefix_cache_hit_rate == pytest.approx(48 / (53 + 55))
    # Reserving ahead is waste until the tokens arrive.
    assert kv.allocate_slots("b", 55 + 32) == [5, 6]
    assert kv.stats().kv_waste_fraction == pytest.approx((112 - 60) / 112)
    free(kv, a)
    free(kv, b)
    stats = kv.stats()
    assert (stats.num_allocated_slots, stats.kv_waste_fraction) == (0, 0.0)
    assert stats.num_evictable_blocks == 3 and all_idle(kv)


def test_caching_off_shares_nothing_and_hashes_nothing() -> None:
    kv = KVCacheManager(10, BS)
    a, b = Seq("a", list(PREFIX)), Seq("b", list(PREFIX))
    admit(kv, a)
    compute(kv, a)
    cached = admit(kv, b)
    assert cached.block_ids == () and cached.num_computed_tokens == 0
    assert kv.block_ids("b") == (3, 4, 5)
    assert kv.pool.num_cached == 0 and kv.new_block_hashes("a", 0, 48, a.token_ids) == []
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    free(kv, a)
    free(kv, b)
    assert kv.pool.num_free == kv.num_blocks


def test_a_cached_prefix_is_only_taken_on_the_first_allocation() -> None:
    kv = make()
    a = Seq("a", list(PREFIX))
    admit(kv, a)
    with pytest.raises(ValueError, match="already owns blocks"):
        kv.allocate_slots("a", 60, kv.get_cached_prefix("a", 48, a.token_ids))
    free(kv, a)


def test_check_integrity_catches_a_write_into_a_cached_block() -> None:
    kv = make()
    a = Seq("a", PREFIX + [1] * 5)
    admit(kv, a)
    compute(kv, a)
    kv._num_live["a"] = 40  # corrupt: a would rewrite position 40, in cached block 2
    with pytest.raises(AssertionError, match="may write block 2, which is cached"):
        kv.check_integrity()
    kv._num_live["a"] = 53
    kv.check_integrity()
    free(kv, a)


def test_reset_prefix_cache_forgets_ownerless_content_and_zeroes_the_counters() -> None:
    """What the engine does after its warm-up: the cached blocks no request owns go back to
    the free list, LRU first, hashes dropped; a running request's cached blocks stay."""
    kv = make(8)
    x, y, z = Seq("x", [1] * 32), Seq("y", [2] * 32), Seq("z", [3] * 32)
    for seq in (x, y):
        admit(kv, seq)
        compute(kv, seq)
    free(kv, x)  # evictable: 1, 0
    x2 = Seq("x2", [1] * 20)
    assert admit(kv, x2).block_ids == (0,)  # a hit on x's head: queries and hits counted
    free(kv, x2)
    admit(kv, z)
    compute(kv, z)
    free(kv, y)
    evictable, free_ids = kv.pool.evictable_block_ids(), kv.pool.free_block_ids()
    assert len(evictable) == 4 and kv.stats().prefix_cache_hits == 16
    assert kv.stats().num_cached_blocks == 6
    assert kv.reset_prefix_cache() == 4
    kv.check_integrity()
    stats = kv.stats()
    assert kv.pool.evictable_block_ids() == [] and stats.num_cached_blocks == 2  # z's
    assert kv.pool.free_block_ids() == free_ids + evictable
    assert stats.prefix_cache_queries == stats.prefix_cache_hits == stats.num_evictions == 0
    assert kv.get_cached_prefix("y2", 32, Seq("y2", [2] * 32).token_ids).block_ids == ()
    z_blocks = kv.block_ids("z")
    assert kv.get_cached_prefix("z2", 32, Seq("z2", [3] * 32).token_ids).block_ids == z_blocks
    free(kv, z)
    assert all_idle(kv)
