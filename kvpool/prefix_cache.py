"""Prefix caching: content hashes of full KV blocks, and the hash -> block map.

A *full* block's hash covers its own tokens and, by chaining, every token before it::

    positions | 0 ........... 15 | 16 .......... 31 | 32 .. 37
    tokens    | block 0 tokens   | block 1 tokens   | partial: no hash (still filling)
    hashes    | h0 = H(ROOT, b0) | h1 = H(h0, b1)   |

so equal hashes at block index ``i`` mean equal first ``(i + 1) * block_size`` tokens. The K/V
of a token depends only on the tokens up to it (causal attention) and on its position (fixed
by ``i``), so block ``i`` of one request can stand in for block ``i`` of another: that is a
cache hit. Partial blocks are never hashed: their content is still growing.

H is SHA-256 over the parent digest and the token ids as 64-bit integers. A 64-bit builtin
hash would be faster, but a collision silently serves one request another's K/V (vLLM moved
to SHA-256 for that reason); hashing 16 ids costs about a microsecond, once per block.

``CachedPrefix`` is the result of one lookup (``KVCacheManager.get_cached_prefix``): the
leading blocks of a request already cached, and how many of its tokens they let it skip.

Ownership: ``PrefixCache`` (held by ``BlockPool``) owns the hash <-> block map; the manager
owns each request's memoized chain of hashes. ``CachedPrefix`` is an immutable value.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, KeysView, Sequence
from dataclasses import dataclass

BlockHash = bytes
# Token ids at positions [start, end) of a request (``Request.token_ids`` has this shape).
TokenSource = Callable[[int, int], Sequence[int]]

# The parent of block 0. Any fixed value works; it only has to differ from every digest.
ROOT_HASH: BlockHash = b"pagedserve-prefix-root"


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Args:
        parent: the hash of the previous block (``ROOT_HASH`` for block 0).
        token_ids: the block's ``block_size`` token ids.
    Returns:
        The chained SHA-256 digest of this block.
    """
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_chain(
    chain: list[BlockHash], num_blocks: int, block_size: int, token_ids: TokenSource
) -> None:
    """Grow ``chain`` in place until it holds the hashes of the first ``num_blocks`` blocks.

    Tokens never change once known (prompt + output only grow), so a chain computed once for
    a request stays valid and is extended, never recomputed.

    Args:
        chain: the hashes known so far (block 0 first).
        num_blocks: blocks the chain must cover; each must be full in ``token_ids``.
        block_size: tokens per block.
        token_ids: the request's tokens by position range.
    """
    for i in range(len(chain), num_blocks):
        parent = chain[i - 1] if i else ROOT_HASH
        tokens = token_ids(i * block_size, (i + 1) * block_size)
        assert len(tokens) == block_size, f"block {i} is not full ({len(tokens)} tokens)"
        chain.append(hash_block(parent, tokens))


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """What the prefix cache holds of a request's known tokens (``get_cached_prefix``)::

        tokens   |<------------------- num_tokens (queried) ------------------->|
        blocks   | hit | hit | hit | miss: next_block_hash | ... | partial      |
                 |<- num_cached_tokens ->|
                 |<- num_computed_tokens ->|  = num_cached_tokens, except when every
                                              token is cached: then num_tokens - 1

    The last token is always computed, because the step must produce its logits. When the
    whole of a block-aligned sequence is cached, that token sits in the last cached block,
    which other requests may share: the request gets a private copy of that block instead
    (copy-on-write, ``copies_last_block``) and recomputes only the one token.

    Args:
        block_ids: the cached leading blocks, block 0 first.
        num_tokens: the request's known tokens at lookup (prompt + output so far).
        num_cached_tokens: tokens in ``block_ids`` (``len(block_ids) * block_size``).
        num_computed_tokens: tokens the request may skip.
        next_block_hash: the hash of the first full block that missed, if any (the scheduler
            checks whether a request in the same step is computing it).
    """

    block_ids: tuple[int, ...]
    num_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    next_block_hash: BlockHash | None = None

    @property
    def copies_last_block(self) -> bool:
        """Whether the last cached block will be written (every token was cached)."""
        return self.num_computed_tokens < self.num_cached_tokens


class PrefixCache:
    """The hash -> block map of cached full blocks, and its inverse.

    NOTE: a bijection between the hashes present and the blocks holding one: a block holds at
    most one hash, and a hash names at most one block. When two requests compute the same
    block independently (both admitted before either finished it), the second copy is simply
    not registered and is recycled like any uncached block when freed.
    """

    def __init__(self) -> None:
        self._block_by_hash: dict[BlockHash, int] = {}
        self._hash_by_block: dict[int, BlockHash] = {}

    def __len__(self) -> int:
        return len(self._block_by_hash)

    def get(self, block_hash: BlockHash) -> int | None:
        """Args:
            block_hash: a chained block hash.
        Returns:
            The block holding that content, or None.
        """
        return self._block_by_hash.get(block_hash)

    def hash_of(self, block_id: int) -> BlockHash | None:
        """Args:
            block_id: a block.
        Returns:
            Its hash if it is cached, else None.
        """
        return self._hash_by_block.get(block_id)

    def insert(self, block_hash: BlockHash, block_id: int) -> None:
        """Register ``block_id`` as holding ``block_hash``.

        Args:
            block_hash: the content hash; must not be registered yet.
            block_id: the block; must hold no hash yet.
        """
        assert block_hash not in self._block_by_hash, f"hash already cached (block {block_id})"
        assert block_id not in self._hash_by_block, f"block {block_id} already holds a hash"
        self._block_by_hash[block_hash] = block_id
        self._hash_by_block[block_id] = block_hash

    def remove(self, block_id: int) -> BlockHash:
        """Drop ``block_id``'s hash (eviction).

        Args:
            block_id: a cached block.
        Returns:
            The hash it held.
        """
        block_hash = self._hash_by_block.pop(block_id)
        del self._block_by_hash[block_hash]
        return block_hash

    def cached_block_ids(self) -> list[int]:
        """Every block holding a hash, in insertion order (a copy, for checks and tests)."""
        return list(self._hash_by_block)

    def check_integrity(self, num_blocks: int) -> None:
        """Raise AssertionError unless every hashed block is in the map exactly once.

        Args:
            num_blocks: the pool size (block ids are ``0 .. num_blocks - 1``).
        """
        by_hash, by_block = self._block_by_hash, self._hash_by_block
        assert len(by_hash) == len(by_block), "hash map is not 1:1"
        ids = by_hash.values()
        in_range = not ids or (min(ids) >= 0 and max(ids) < num_blocks)
        # The two maps invert each other, compared at C speed (a pool's every block may be
        # cached, and a GPU's holds tens of thousands). A failure walks them to name the
        # block.
        if in_range and dict(zip(ids, by_hash.keys(), strict=True)) == by_block:
            return
        for block_hash, block_id in by_hash.items():
            assert 0 <= block_id < num_blocks, f"cached block id {block_id} out of range"
            assert by_block.get(block_id) == block_hash, (
                f"block {block_id} is mapped under a hash it does not hold"
            )
        raise AssertionError("hash map is not 1:1")

    def hashed_block_ids(self) -> KeysView[int]:
        """The cached blocks' ids: a live view, for set algebra without a copy."""
        return self._hash_by_block.keys()
