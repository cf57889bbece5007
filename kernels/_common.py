"""Launcher helpers shared by the Triton kernels in this folder (no kernels here).

Imports only torch, so it is safe on any code path; the kernel files import triton. The
launch settings that need no torch (environment switches, size rules) are
``kernels/settings.py``'s.
"""

from __future__ import annotations

import functools

import torch

from kernels import kv_quant

__all__ = [
    "SUPPORTED_DTYPES",
    "attention_dtype",
    "check_attention_inputs",
    "check_kv_cache",
    "dot_precision",
    "num_compute_units",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
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
    Blocks may be strided arbitrarily otherwise, e.g. views into one [2, ...] tensor. A
    quantized cache (int8 / fp8) must be the values view of ``kernels/kv_quant.py``'s layout.
    """
    assert key_cache.dim() == 4, f"key_cache must be 4-D, got {tuple(key_cache.shape)}"
    assert key_cache.shape == value_cache.shape, (key_cache.shape, value_cache.shape)
    assert key_cache.dtype == value_cache.dtype, (key_cache.dtype, value_cache.dtype)
    assert key_cache.dtype in SUPPORTED_DTYPES or kv_quant.is_quantized(key_cache), (
        f"unsupported cache dtype {key_cache.dtype}"
    )
    assert key_cache.device == value_cache.device
    assert key_cache.stride() == value_cache.stride(), (key_cache.stride(), value_cache.stride())
    assert key_cache.stride(3) == 1, "head_dim of the cache must be contiguous"
    if kv_quant.is_quantized(key_cache):
        kv_quant.cache_rows(key_cache)  # asserts the values-then-scale row layout


def attention_dtype(query: torch.Tensor, key_cache: torch.Tensor) -> torch.dtype:
    """The dtype attention multiplies in: the cache's, or the query's for a quantized cache
    (whose 8-bit values are exact in any of the supported dtypes)."""
    return query.dtype if kv_quant.is_quantized(key_cache) else key_cache.dtype


def check_attention_inputs(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] (decode: one token a sequence)
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
) -> None:
    """Assert what every paged-attention launcher needs of its common inputs.

    The cache pair as in ``check_kv_cache``; query heads a multiple of KV heads (GQA), of the
    cache's head size and dtype, with ``head_dim`` contiguous; one contiguous int32 row of
    block table and one int32 length per sequence; everything on one device. Each launcher
    then checks its own inputs (decode: one query per sequence; prefill: query_start_loc).
    """
    check_kv_cache(key_cache, value_cache)
    _, num_heads, head_dim = query.shape
    _, _, num_kv_heads, cache_head_dim = key_cache.shape
    assert seq_lens.dtype == torch.int32 and seq_lens.dim() == 1, seq_lens
    num_seqs = seq_lens.shape[0]
    assert cache_head_dim == head_dim, (query.shape, key_cache.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    if kv_quant.is_quantized(key_cache):  # de-quantized to float32 as it is read
        assert query.dtype in SUPPORTED_DTYPES, query.dtype
    else:
        assert query.dtype == key_cache.dtype, (query.dtype, key_cache.dtype)
    assert query.stride(2) == 1, "head_dim of query must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, block_tables.shape
    assert block_tables.dtype == torch.int32, block_tables.dtype
    assert block_tables.stride(1) == 1, "each block-table row must be contiguous"
    assert seq_lens.is_contiguous()
    assert query.device == key_cache.device == block_tables.device == seq_lens.device


def check_out(out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """The tensor an attention launcher writes: ``out`` where the caller gives one (shaped,
    typed and placed like ``query``, ``head_dim`` contiguous; rows and heads at any stride,
    e.g. rows of a larger buffer), else a new one like ``query``."""
    if out is None:
        return torch.empty_like(query)
    assert out.shape == query.shape, (out.shape, query.shape)
    assert out.dtype == query.dtype and out.device == query.device, (out.dtype, out.device)
    assert out.stride(2) == 1, "head_dim of out must be contiguous"
    return out
