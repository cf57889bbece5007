"""kvpool: the paged KV cache.

Ownership:
  - ``BlockPool`` owns the free list, the evictable cached blocks (LRU) and reference counts,
    and through ``PrefixCache`` the hash <-> block map (pure Python).
  - ``KVCacheManager`` owns each request's block table (request id -> block ids), its live
    token count and hash chain, the slot mapping derived from them, and the copy-on-write
    copies queued for the next step (pure Python).
  - ``KVCacheStorage`` owns the K/V tensors; only ``kernels.store_kv`` writes tokens into
    them, and ``KVCacheStorage.copy_blocks`` copies whole blocks (copy-on-write).
"""

from kvpool.block_pool import BlockPool, NoFreeBlocksError
from kvpool.config import KVPoolConfig
from kvpool.manager import KVCacheManager
from kvpool.prefix_cache import CachedPrefix, PrefixCache
from kvpool.stats import KVCacheStats

__all__ = [
    "BlockPool",
    "CachedPrefix",
    "KVCacheManager",
    "KVCacheStats",
    "KVPoolConfig",
    "NoFreeBlocksError",
    "PrefixCache",
]
