"""Triton ``store_kv``: scatter this step's K/V rows into their slots of the paged cache.

Import the launcher explicitly (``kernels/__init__.py`` never imports triton)::

    from kernels.store_kv import store_kv

Same signature and semantics as ``kernels.reference.store_kv``. Grid: one program per token;
each program copies that token's whole ``[num_kv_heads, head_dim]`` row of K and of V, so a
row is read once and written once with vector loads along ``head_dim``. A slot of -1
(padding, e.g. a CUDA-graph batch padded to a fixed size) makes the program store nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_kv_cache
from kernels._kv_quant_triton import (
    hadamard_rows,
    key_offset_arg,
    quant_args,
    quantize_rows,
    scale_ptrs,
)
from kernels.settings import next_power_of_2

__all__ = ["store_kv"]


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int32/int64, -1 = skip
    key_offset_ptr,  # [num_kv_heads, head_dim] float32, read with HAS_KEY_OFFSET
    stride_key_token: tl.int64,
    stride_key_head: tl.int64,
    stride_value_token: tl.int64,
    stride_value_head: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    stride_cache_head: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,  # next power of two of NUM_KV_HEADS (tl.arange needs one)
    HEAD_DIM_PAD: tl.constexpr,  # next power of two of HEAD_DIM
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,  # 8-bit rows + a float16 scale each (kernels/kv_quant.py)
    QMAX: tl.constexpr,
    ROUND_TO_INT: tl.constexpr,
    SOFT_FP8_ROUND: tl.constexpr,  # see kernels/_kv_quant_triton.quant_args
    HADAMARD_BLOCK: tl.constexpr,  # keys' Hadamard blocks (kv_quant.hadamard_block)
    HAS_KEY_OFFSET: tl.constexpr,  # keys less key_offset before quantizing (kv_quant.py)
):
    token = tl.program_id(0).to(tl.int64)
    # int64 before any arithmetic: block_id * stride_cache_block overflows int32 once the
    # pool holds more than 2**31 elements (about 4 GiB of fp16 per layer).
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, KV_HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    src_key = token * stride_key_token + offs_h[:, None] * stride_key_head + offs_d[None, :]
    src_value = token * stride_value_token + offs_h[:, None] * stride_value_head + offs_d[None, :]
    dst = (
        block_id * stride_cache_block
        + offset * stride_cache_slot
        + offs_h[:, None] * stride_cache_head
        + offs_d[None, :]
    )
    k = tl.load(key_ptr + src_key, mask=mask, other=0.0)  # [KV_HEADS_PAD, HEAD_DIM_PAD]
    v = tl.load(value_ptr + src_value, mask=mask, other=0.0)
    if QUANTIZED:
        k = k.to(tl.float32)
        if HAS_KEY_OFFSET:  # padding rows and columns stay 0
            k -= tl.load(
                key_offset_ptr + offs_h[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0
            )
        # Keys Hadamard-transformed first; padding columns are whole zero blocks.
        k = hadamard_rows(k, KV_HEADS_PAD, HEAD_DIM_PAD, HADAMARD_BLOCK)
        k, k_scale = quantize_rows(k, QMAX, ROUND_TO_INT, SOFT_FP8_ROUND)
        v, v_scale = quantize_rows(v.to(tl.float32), QMAX, ROUND_TO_INT, SOFT_FP8_ROUND)
        rows = (
            block_id * stride_cache_block + offset * stride_cache_slot + offs_h * stride_cache_head
        )
        h_mask = offs_h < NUM_KV_HEADS
        tl.store(scale_ptrs(key_cache_ptr + rows, HEAD_DIM), k_scale, mask=h_mask)
        tl.store(scale_ptrs(value_cache_ptr + rows, HEAD_DIM), v_scale, mask=h_mask)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (int32 accepted), -1 = skip
    key_offset: torch.Tensor | None = None,  # [num_kv_heads, head_dim] float32
) -> None:
    """Write each token's K/V row into its slot of the paged cache, in place.

    ``key``/``value`` may be strided views (e.g. slices of a fused QKV projection) as long
    as ``head_dim`` is contiguous; they are cast to the cache dtype on store, rounding to
    nearest even like torch (NOTE: Triton 3.x's CPU interpreter truncates fp32 -> bf16), or
    quantized with a scale per (token, KV head), keys Hadamard-transformed, into a
    quantized cache (kernels/kv_quant.py), keys less ``key_offset`` when given.
    """
    check_kv_cache(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_tokens = key.shape[0]
    assert key.shape == (num_tokens, num_kv_heads, head_dim), (key.shape, key_cache.shape)
    assert value.shape == key.shape, (value.shape, key.shape)
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim of key/value must be contiguous"
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
    assert slot_mapping.dtype in (torch.int32, torch.int64), slot_mapping.dtype
    assert slot_mapping.is_contiguous()
    assert key.device == value.device == key_cache.device == slot_mapping.device
    offset_ptr, has_offset = key_offset_arg(key_cache, key_offset)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        offset_ptr,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        HAS_KEY_OFFSET=has_offset,
        **quant_args(_store_kv_kernel, key_cache),
    )
