"""Launcher helpers shared by the Triton kernels in this folder (no kernels here).

Imports only torch, so it is safe on any code path; the kernel files import triton.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "check_kv_cache",
    "dot_precision",
    "next_power_of_2",
    "num_compute_units",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision for this data type.

    fp32 inputs would default to TF32 on tensor cores (10-bit mantissa), which is far from
    the float32 reference; "ieee" keeps fp32 exact. fp16/bf16 ignore the setting.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=8)
def num_compute_units(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (what split-K fills); 1 elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def check_kv_cache(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
) -> None:
    """Assert the cache pair has the layout the kernels address.

    Both tensors must share shape, dtype, device and strides (the kernels get one set of
    cache strides), and the head dimension must be contiguous (rows are loaded as vectors).
    Blocks may be strided arbitrarily otherwise, e.g. views into one [2, ...] tensor.
    """
    assert key_cache.dim() == 4, f"key_cache must be 4-D, got {tuple(key_cache.shape)}"
    assert key_cache.shape == value_cache.shape, (key_cache.shape, value_cache.shape)
    assert key_cache.dtype == value_cache.dtype, (key_cache.dtype, value_cache.dtype)
    assert key_cache.dtype in SUPPORTED_DTYPES, f"unsupported cache dtype {key_cache.dtype}"
    assert key_cache.device == value_cache.device
    assert key_cache.stride() == value_cache.stride(), (key_cache.stride(), value_cache.stride())
    assert key_cache.stride(3) == 1, "head_dim of the cache must be contiguous"
