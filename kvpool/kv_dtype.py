"""Bytes per cached token for each KV cache dtype: the one rule the pool's sizing, the
MBU gauge and the planner (``pagedserve plan``) all count with.

A quantized cache (``int8``, ``fp8``) holds one byte per K/V element plus a float16 scale
per (slot, KV head) row of K and of V (the layout: ``kernels/kv_quant.py``), so a token costs
``2 * layers * kv_heads * (head_dim + 2)`` bytes instead of ``2 * layers * kv_heads *
head_dim * element_bytes``: 3.88x fewer than float32 and 1.94x fewer than 16-bit at
head_dim 64, 3.94x and 1.97x at head_dim 128. Pure arithmetic, no torch.
"""

from __future__ import annotations

__all__ = ["KV_CACHE_DTYPES", "QUANTIZED_KV_DTYPES", "SCALE_BYTES", "kv_bytes_per_token"]

# What --kv-cache-dtype accepts ("auto": the model's dtype).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QUANTIZED_KV_DTYPES = ("int8", "fp8")
# The scale after each quantized row; kernels/kv_quant.py's SCALE_BYTES (asserted equal there
# by tests/kernels/test_kv_quant.py, since kernels/ may not import kvpool/).
SCALE_BYTES = 2


def kv_bytes_per_token(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: str,
    element_bytes: float | None = None,
) -> float:
    """Bytes one token's K and V take in the cache, over every layer.

    Args:
        kv_dtype: "int8" / "fp8" (quantized: a byte per element plus the scales), or any
            unquantized dtype, whose ``element_bytes`` must then be given ("auto" means the
            model's dtype: pass its size).
        element_bytes: bytes per element of an unquantized cache (4 for float32, 2 for
            bf16/fp16).

    Returns:
        An int-valued float for every real dtype (a float so the planner's fractional
        int4-style sizes pass through unchanged).
    """
    rows = 2 * num_layers * num_kv_heads  # one K and one V row per KV head per layer
    if kv_dtype in QUANTIZED_KV_DTYPES:
        return float(rows * (head_dim + SCALE_BYTES))
    if element_bytes is None:
        raise ValueError(f"kv dtype {kv_dtype!r} needs its element size")
    return rows * head_dim * element_bytes
