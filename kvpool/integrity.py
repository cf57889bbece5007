"""The block-table integrity check, run by tests after every step
(``KVCacheManager.check_integrity``).

It reads the manager's tables and the pool; it changes nothing. The invariants it asserts
are listed on ``KVCacheManager``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvpool.block_pool import BlockPool


def check_block_tables(
    pool: BlockPool,
    block_size: int,
    block_tables: Mapping[str, Sequence[int]],
    num_live: Mapping[str, int],
    num_hashed: Mapping[str, int],
    *,
    num_live_slots: int,
) -> None:
    """Raise AssertionError unless: no request owns a block twice; every used block's ref
    count equals its owners; shared blocks are cached; every block a request may still write
    is private and unhashed; and the live slots add up.

    Args:
        pool: the block pool the tables are drawn from (checked on its own by the caller).
        block_size: token slots per block.
        block_tables: request id -> its block ids.
        num_live: request id -> its computed (live) tokens.
        num_hashed: request id -> leading blocks of its table already hashed.
        num_live_slots: the live slots the manager reports (``KVCacheStats``), which must
            equal the slots the tables fill, each block counted once.
    """
    bs = block_size
    owners = [0] * pool.num_blocks
    live_per_block = [0] * pool.num_blocks
    for request_id, table in block_tables.items():
        assert len(set(table)) == len(table), f"{request_id} owns a block twice"
        assert request_id in num_live, f"{request_id} has no live-token count"
        live = num_live[request_id]
        assert 0 <= live <= len(table) * bs, f"{request_id}: {live} live tokens"
        assert num_hashed[request_id] <= len(table)
        for i, block_id in enumerate(table):
            owners[block_id] += 1
            filled = min(bs, max(0, live - i * bs))
            live_per_block[block_id] = max(live_per_block[block_id], filled)
    for block_id, count in enumerate(owners):
        assert count == pool.ref_count(block_id), (
            f"block {block_id}: {count} owners, ref count {pool.ref_count(block_id)}"
        )
        if count > 1:
            assert pool.cache.hash_of(block_id) is not None, f"shared block {block_id}"
    for request_id, table in block_tables.items():
        for block_id in table[num_live[request_id] // bs :]:
            assert pool.ref_count(block_id) == 1, (
                f"{request_id} may write block {block_id}, which is shared"
            )
            assert pool.cache.hash_of(block_id) is None, (
                f"{request_id} may write block {block_id}, which is cached"
            )
    assert num_live_slots == sum(live_per_block), "live slots do not add up"
