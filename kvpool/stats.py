"""KVCacheStats: a snapshot of the KV pool, emitted as plain data for the metrics layer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """Pool occupancy, prefix-cache counters and KV waste (``KVCacheManager.stats()``).

    Every block is free, evictable or used (``num_free + num_evictable + num_used ==
    num_blocks``). *Allocated* slots are those of used blocks; *live* slots hold a computed
    token of a request that owns the block (a shared block counts once). The rest of the
    allocated slots are waste: the unfilled tail of each request's last block, and blocks
    reserved ahead of the tokens that will fill them::

        request table | full | full | 5 of 16 |  (+ reserved, empty blocks)
        slots         |<---- live: 37 ---->|<-- waste: 11 + 16 per empty block -->|

    Args:
        block_size: tokens per block.
        num_blocks: blocks in the pool.
        num_used_blocks: blocks with at least one owner.
        num_free_blocks: blocks on the free list (never cached, or evicted).
        num_evictable_blocks: ownerless blocks that still hold cached prefix content.
        num_cached_blocks: blocks holding a prefix hash, used or evictable.
        num_live_slots: allocated slots holding computed tokens.
        prefix_cache_queries: tokens looked up in the prefix cache at admission, since start.
        prefix_cache_hits: of those, tokens found cached (and not recomputed), since start.
        num_evictions: cached blocks evicted (hash dropped) to be reused, since start.
    """

    block_size: int
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_evictable_blocks: int
    num_cached_blocks: int
    num_live_slots: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_evictions: int = 0

    @property
    def num_allocated_slots(self) -> int:
        """Slots of used blocks."""
        return self.num_used_blocks * self.block_size

    @property
    def kv_waste_fraction(self) -> float:
        """(allocated - live) / allocated; 0.0 when nothing is allocated."""
        allocated = self.num_allocated_slots
        return (allocated - self.num_live_slots) / allocated if allocated else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """hits / queries in tokens since start; 0.0 before the first query."""
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0
