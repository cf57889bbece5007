"""KVPoolConfig: how the paged KV cache is sized."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.kv_dtype import KV_CACHE_DTYPES

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class KVPoolConfig:
    """Args:
    block_size: tokens per block (a power of two; 16 like vLLM).
    memory_bytes: KV cache budget in bytes; ``None`` picks a default for the device
        (1 GiB on CPU; on CUDA from ``gpu_memory_utilization``, else 90% of the memory free
        after the weights and the steps' reserve).
    gpu_memory_utilization: the share of the GPU's total memory this engine may take, the
        weights, the steps' activations, the CUDA graphs and the KV cache together (vLLM's
        flag of the name): the KV cache gets what the rest leaves of it, and never more than
        the default would. Two servers on one GPU take a share each. CUDA only;
        ``memory_bytes`` and ``num_blocks`` override it.
    num_blocks: an exact block count; overrides ``memory_bytes`` (tests use it to force
        memory pressure).
    enable_prefix_caching: share the K/V of full blocks whose token prefix is already
        cached (hash-chained, LRU-evicted; ``kvpool/prefix_cache.py``). On by default, as in
        vLLM; the server's ``--no-prefix-caching`` turns it off.
    cache_dtype: "auto" (K/V in the model's dtype), "int8" or "fp8" (e4m3): 8-bit values
        with a float16 scale per (slot, KV head) row, keys Hadamard-transformed
        (``kernels/kv_quant.py``); lossy.
    key_offsets: with a quantized ``cache_dtype``, subtract a per-(layer, KV head) key
        offset, calibrated at start-up (``engine/kv_calibration.py``), from every key
        before quantizing it: exact for attention, less error in most keys (not in the
        first tokens'). Off by default; the server's ``--kv-key-offsets`` turns it on.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"
    key_offsets: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ValueError(f"memory_bytes must be positive, got {self.memory_bytes}")
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be a share of the GPU's memory in (0, 1], got {share}"
            )
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.cache_dtype!r}"
            )
