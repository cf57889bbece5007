"""kvpool: the paged KV cache.

Ownership:
  - ``BlockPool`` owns the free list and reference counts (pure Python).
  - ``KVCacheManager`` owns each request's block table (request id -> block ids) and the
    slot mapping derived from it (pure Python).
  - ``KVCacheStorage`` owns the K/V tensors; only ``kernels.store_kv`` writes into them.
"""

from kvpool.block_pool import BlockPool, NoFreeBlocksError
from kvpool.config import KVPoolConfig
from kvpool.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager", "KVPoolConfig", "NoFreeBlocksError"]
