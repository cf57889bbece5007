"""KVCacheStorage: the K/V tensors of every layer, and the capacity arithmetic.

Owns: the cache tensors. Only the ``store_kv`` kernel (``kernels/``) writes tokens into them,
and ``copy_blocks`` copies whole blocks for copy-on-write; the attention kernels read them
through block tables.

Layout, one pair per layer (the layout both the reference and the Triton kernels read)::

    key_caches[layer], value_caches[layer]: [num_blocks, block_size, num_kv_heads, head_dim]

With a quantized cache (``KVPoolConfig.cache_dtype`` int8 / fp8) each of those is the values
view of a ``[num_blocks, block_size, num_kv_heads, head_dim + 2]`` 8-bit tensor whose last
2 bytes per row hold the row's float16 scale (``kernels/kv_quant.py``); this class keeps the
raw tensors too, so whole-block copies carry the scales.

A quantized cache also owns its **key offsets** (``key_offsets``): one ``[num_kv_heads,
head_dim]`` float32 vector per layer, calibrated by the engine at start-up, that every store
subtracts from the keys before quantizing them (``kernels/kv_quant.py``; attention is
unchanged by it). The offsets are fixed for the cache's lifetime, so every block stays
valid wherever it is copied or shared (prefix caching) and whenever it is recomputed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import kv_quant
from kvpool import host_memory
from kvpool.config import KVPoolConfig
from kvpool.kv_dtype import QUANTIZED_KV_DTYPES
from kvpool.kv_dtype import kv_bytes_per_token as bytes_per_token_of

logger = logging.getLogger(__name__)

DEFAULT_CPU_BUDGET_BYTES = 1 << 30  # 1 GiB
DEFAULT_GPU_FRACTION = 0.9


@dataclass(frozen=True, slots=True)
class KVCapacity:
    """How much KV cache a budget buys."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    cache_dtype: str = "auto"  # KVPoolConfig.cache_dtype; "auto": the model's dtype

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.num_tokens} tokens, {self.bytes_per_token} bytes/token "
            f"({self.cache_dtype}), {self.total_bytes / 2**20:.1f} MiB"
        )


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, cache_dtype: str = "auto"
) -> int:
    """2 (K and V) * layers * kv heads * head dim * bytes per element; a quantized
    ``cache_dtype`` counts one byte per element plus the rows' scales (kvpool/kv_dtype.py)."""
    return int(bytes_per_token_of(num_layers, num_kv_heads, head_dim, cache_dtype, dtype.itemsize))


def check_cache_dtype(cache_dtype: str, head_dim: int) -> None:
    """Refuse a quantized cache the kernels cannot address (one line, for the CLI)."""
    # Even: each row's float16 scale then sits on a 2-byte boundary (rows of head_dim + 2).
    if cache_dtype in QUANTIZED_KV_DTYPES and head_dim % 2:
        raise ValueError(
            f"--kv-cache-dtype {cache_dtype} needs an even head_dim (the model's is {head_dim})"
        )


def size_kv_cache(
    config: KVPoolConfig,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCapacity:
    """Turn the pool config into a block count.

    ``num_blocks`` wins if given; else ``memory_bytes``; else a device default (1 GiB on CPU,
    90% of the free memory on CUDA, measured after the weights are loaded).
    """
    check_cache_dtype(config.cache_dtype, head_dim)
    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, config.cache_dtype)
    if config.num_blocks is not None:
        return KVCapacity(config.num_blocks, config.block_size, per_token, config.cache_dtype)
    budget = config.memory_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * DEFAULT_GPU_FRACTION)
        else:
            budget = DEFAULT_CPU_BUDGET_BYTES
    num_blocks = budget // (per_token * config.block_size)
    if num_blocks < 1:
        raise ValueError(
            f"a KV budget of {budget} bytes (--kv-cache-memory) holds no block of "
            f"{config.block_size} tokens at {per_token} bytes/token: give it at least "
            f"{per_token * config.block_size} bytes"
        )
    return KVCapacity(num_blocks, config.block_size, per_token, config.cache_dtype)


class KVCacheStorage:
    """Per-layer K and V tensors, allocated once at start-up."""

    def __init__(
        self,
        capacity: KVCapacity,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        key_offsets: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Args:
        key_offsets: a quantized cache's per-layer key offsets (``[num_kv_heads, head_dim]``
            each, copied here as float32); None: none (the keys are stored as they are).
        """
        shape = (capacity.num_blocks, capacity.block_size, num_kv_heads, head_dim)
        self.capacity = capacity
        quantized = capacity.cache_dtype in QUANTIZED_KV_DTYPES
        if quantized:
            # 8-bit rows with their scale appended (kernels/kv_quant.py).
            dtype = kv_quant.ELEMENT_DTYPES[capacity.cache_dtype]
            shape = (*shape[:3], head_dim + kv_quant.SCALE_BYTES)

        # Zero-filled, not empty: padding rows of a partly filled block are masked by the
        # kernels, but NaN garbage times a zero weight is still NaN. On CPU, on huge pages:
        # attention walks scattered blocks, a TLB miss per 4 KiB page otherwise
        # (kvpool/host_memory.py).
        def zeros() -> torch.Tensor:
            if torch.device(device).type == "cpu":
                return host_memory.zeros(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)

        # What copy_blocks copies (with the scales); the model gets key/value_caches.
        self.raw_caches = [zeros() for _ in range(2 * num_layers)]
        views = (
            [kv_quant.quantized_cache(raw) for raw in self.raw_caches]
            if quantized
            else self.raw_caches
        )
        self.key_caches = views[:num_layers]
        self.value_caches = views[num_layers:]
        self.key_offsets: list[torch.Tensor] | None = None
        if key_offsets is not None:
            if not quantized:
                raise ValueError("key offsets are for a quantized KV cache only")
            if len(key_offsets) != num_layers:
                raise ValueError(f"{len(key_offsets)} key offsets for {num_layers} layers")
            self.key_offsets = [
                o.to(device=device, dtype=torch.float32, copy=True).contiguous()
                for o in key_offsets
            ]
            for o in self.key_offsets:
                if o.shape != (num_kv_heads, head_dim):
                    raise ValueError(
                        f"a key offset of shape {tuple(o.shape)}, not {(num_kv_heads, head_dim)}"
                    )
        logger.info("%s", capacity.describe())

    @property
    def num_blocks(self) -> int:
        return self.capacity.num_blocks

    @property
    def block_size(self) -> int:
        return self.capacity.block_size

    def copy_blocks(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy whole blocks, every layer, K and V: block ``src_ids[i]`` into ``dst_ids[i]``.

        The copy-on-write half of prefix caching (``KVCacheManager.take_blocks_to_copy``):
        the runner calls it before the forward pass of the step that queued the copies.

        NOTE: all sources are gathered before any destination is written, so a block that
        is a destination of one pair and the source of another is read intact.

        Args:
            src_ids: blocks to read.
            dst_ids: blocks to overwrite, as many as ``src_ids``, all distinct.
        """
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} sources for {len(dst_ids)} destinations")
        if len(set(dst_ids)) != len(dst_ids):
            raise ValueError(f"destination blocks repeat: {list(dst_ids)}")
        if not src_ids:
            return
        device = self.key_caches[0].device
        # Built on the host and copied without waiting: torch.tensor(..., device=cuda) would
        # wait for the device's queue, and the step before may still be running on it.
        src = torch.tensor(list(src_ids), dtype=torch.int64).to(device, non_blocking=True)
        dst = torch.tensor(list(dst_ids), dtype=torch.int64).to(device, non_blocking=True)
        for cache in self.raw_caches:
            # [num_copies, block_size, num_kv_heads, head_dim]: index_select materialises
            # every source before index_copy_ writes. 8-bit caches are copied as their bytes
            # (the same storage): torch's CPU index_copy_ has no float8_e4m3fn kernel.
            if cache.element_size() == 1:
                cache = cache.view(torch.uint8)
            cache.index_copy_(0, dst, cache.index_select(0, src))
