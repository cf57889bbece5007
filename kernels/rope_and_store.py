"""Triton RoPE on Q and K fused with the KV-cache store.

Import the launcher explicitly (``kernels/__init__.py`` never imports triton)::

    from kernels.rope_and_store import rope_and_store_

Same signature and semantics as ``kernels.reference.rope_and_store_`` (the engine's
``PagedAttention.rope_and_store`` with ``store_kv``): one kernel reads the qkv projection's
output, rotates Q and K (Llama's "rotate_half" convention), writes rotated K and V to their
slots of the paged cache and rotated Q back over Q's part of ``qkv``::

    qkv row:  | q head 0 .. q head H-1 | k head 0 .. k head KV-1 | v head 0 .. v head KV-1 |
               rotated in place          rotated -> key_cache      copied -> value_cache
    rotate:   x * cos + rotate_half(x) * sin,  rotate_half(x) = [-x2, x1],  x = [x1, x2]

Grid ``(num_tokens, cdiv(num_heads + num_kv_heads, BLOCK_H))``: a program rotates a tile of
``BLOCK_H`` heads of one token (Q heads, then K heads; about 4,096 values), writes its Q rows
back, and its K rows with the matching V heads to the token's slot; slot -1 (padding)
stores nothing to the cache. All by masks: no branch depends on a value.
Each product and the sum are rounded to the dtype as torch's op-by-op evaluation rounds them,
and ``enable_fp_fusion=False`` stops the compiler from contracting them into an FMA, so the
result is bitwise torch's in every dtype. The grid comes from shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import kv_quant
from kernels._common import SUPPORTED_DTYPES, check_kv_cache
from kernels._kv_quant_triton import (
    hadamard_rows,
    key_offset_arg,
    quant_args,
    quantize_by,
    row_scales,
    scale_ptrs,
)
from kernels._triton_common import pdl_args, pdl_enter, round_args, round_to
from kernels.settings import next_power_of_2

__all__ = ["COMPILE_OPTIONS", "choose_block_h", "rope_and_store_"]

# The compile options of every launch. No fp fusion: x * cos + r * sin must not become an
# FMA, so that the result is bitwise torch's.
COMPILE_OPTIONS: dict[str, object] = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def _rope_and_store_kernel(
    qkv_ptr,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]; Q rotated in place
    cos_ptr,  # [num_tokens, head_dim]
    sin_ptr,  # [num_tokens, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int32/int64, -1 = skip
    key_offset_ptr,  # [num_kv_heads, head_dim] float32, read with HAS_KEY_OFFSET
    stride_qkv_token: tl.int64,
    stride_cos_token: tl.int64,
    stride_sin_token: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    stride_cache_head: tl.int64,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,  # next power of two of HEAD_DIM // 2
    BLOCK_H: tl.constexpr,  # Q/K heads per program, a power of two
    BLOCK_SIZE: tl.constexpr,
    DTYPE: tl.constexpr,
    SOFT_BF16_ROUND: tl.constexpr,  # see kernels/_triton_common.round_args
    QUANTIZED: tl.constexpr,  # 8-bit rows + a float16 scale each (kernels/kv_quant.py)
    QMAX: tl.constexpr,
    ROUND_TO_INT: tl.constexpr,
    SOFT_FP8_ROUND: tl.constexpr,  # see kernels/_kv_quant_triton.quant_args
    HADAMARD_BLOCK: tl.constexpr,  # keys' Hadamard blocks (kv_quant.hadamard_block)
    HAS_KEY_OFFSET: tl.constexpr,  # keys less key_offset before quantizing (kv_quant.py)
    PDL: tl.constexpr,  # a programmatic dependent launch (kernels/_triton_common.pdl_enter)
):
    token = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    # Rows of this program's tile: Q heads 0..NUM_HEADS-1, then K heads, BLOCK_H at a time.
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    mask = (offs_h < NUM_HEADS + NUM_KV_HEADS)[:, None] & d_mask[None, :]

    # The step's tables and slots, loaded before pdl_enter: a dependent launch reads them
    # while the kernel before (the qkv projection) still runs. No kernel of a layer writes
    # them; the step's inputs are in place before its first kernel.
    cos = cos_ptr + token * stride_cos_token + offs_d
    sin = sin_ptr + token * stride_sin_token + offs_d
    # Both halves of each table are read: the kernel assumes nothing of their contents.
    cos1 = tl.load(cos, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    # int64 before any arithmetic: block_id * stride_cache_block passes 2**31 in a large pool.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    pdl_enter(PDL)

    src = qkv_ptr + token * stride_qkv_token + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, HALF_PAD]
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # V of the K rows, issued with the other loads of the projection.
    k_rows = mask & (offs_h >= NUM_HEADS)[:, None]
    value = src + NUM_KV_HEADS * HEAD_DIM  # V head h sits KV heads past K head h
    v1 = tl.load(value, mask=k_rows)
    v2 = tl.load(value + HALF, mask=k_rows)
    # torch: x * cos + cat(-x2, x1) * sin, each product rounded, then the sum.
    out1 = round_to(
        round_to(x1 * cos1, DTYPE, SOFT_BF16_ROUND) - round_to(x2 * sin1, DTYPE, SOFT_BF16_ROUND),
        DTYPE, SOFT_BF16_ROUND,
    ).to(DTYPE)  # fmt: skip
    out2 = round_to(
        round_to(x2 * cos2, DTYPE, SOFT_BF16_ROUND) + round_to(x1 * sin2, DTYPE, SOFT_BF16_ROUND),
        DTYPE, SOFT_BF16_ROUND,
    ).to(DTYPE)  # fmt: skip

    q_mask = mask & (offs_h < NUM_HEADS)[:, None]
    tl.store(src, out1, mask=q_mask)
    tl.store(src + HALF, out2, mask=q_mask)

    # K rows of a token with a slot; the others (Q rows, padding tokens) store nothing, and
    # their addresses (negative KV head, slot -1) are never dereferenced.
    has_slot = (tl.zeros([BLOCK_H], tl.int64) + slot) >= 0  # as a vector: masks are tensors
    k_mask = k_rows & has_slot[:, None]
    kv_head = offs_h - NUM_HEADS
    dst = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_slot
        + kv_head[:, None] * stride_cache_head
        + offs_d[None, :]
    )
    if QUANTIZED:
        # A row's scale is over both halves; Q rows (and padding) are zeros here, unstored.
        # The keys' Hadamard blocks never straddle the halves (kv_quant.hadamard_block), so
        # each half is transformed on its own.
        k1 = tl.where(k_mask, out1.to(tl.float32), 0.0)
        k2 = tl.where(k_mask, out2.to(tl.float32), 0.0)
        if HAS_KEY_OFFSET:  # the rows not stored stay 0
            offset = key_offset_ptr + kv_head[:, None] * HEAD_DIM + offs_d[None, :]
            k1 -= tl.load(offset, mask=k_mask, other=0.0)
            k2 -= tl.load(offset + HALF, mask=k_mask, other=0.0)
        k1 = hadamard_rows(k1, BLOCK_H, HALF_PAD, HADAMARD_BLOCK)
        k2 = hadamard_rows(k2, BLOCK_H, HALF_PAD, HADAMARD_BLOCK)
        f1 = tl.where(k_mask, v1.to(tl.float32), 0.0)
        f2 = tl.where(k_mask, v2.to(tl.float32), 0.0)
        k_scale = row_scales(tl.maximum(tl.max(tl.abs(k1), 1), tl.max(tl.abs(k2), 1)), QMAX)
        v_scale = row_scales(tl.maximum(tl.max(tl.abs(f1), 1), tl.max(tl.abs(f2), 1)), QMAX)
        k1 = quantize_by(k1, k_scale, QMAX, ROUND_TO_INT, SOFT_FP8_ROUND)
        k2 = quantize_by(k2, k_scale, QMAX, ROUND_TO_INT, SOFT_FP8_ROUND)
        f1 = quantize_by(f1, v_scale, QMAX, ROUND_TO_INT, SOFT_FP8_ROUND)
        f2 = quantize_by(f2, v_scale, QMAX, ROUND_TO_INT, SOFT_FP8_ROUND)
        elem = key_cache_ptr.dtype.element_ty
        tl.store(key_cache_ptr + dst, k1.to(elem), mask=k_mask)
        tl.store(key_cache_ptr + dst + HALF, k2.to(elem), mask=k_mask)
        tl.store(value_cache_ptr + dst, f1.to(elem), mask=k_mask)
        tl.store(value_cache_ptr + dst + HALF, f2.to(elem), mask=k_mask)
        rows = (
            (slot // BLOCK_SIZE) * stride_cache_block
            + (slot % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )  # [BLOCK_H], each K row's start
        row_mask = (offs_h >= NUM_HEADS) & (offs_h < NUM_HEADS + NUM_KV_HEADS) & has_slot
        tl.store(scale_ptrs(key_cache_ptr + rows, HEAD_DIM), k_scale, mask=row_mask)
        tl.store(scale_ptrs(value_cache_ptr + rows, HEAD_DIM), v_scale, mask=row_mask)
    else:
        tl.store(key_cache_ptr + dst, out1, mask=k_mask)
        tl.store(key_cache_ptr + dst + HALF, out2, mask=k_mask)
        tl.store(value_cache_ptr + dst, v1, mask=k_mask)
        tl.store(value_cache_ptr + dst + HALF, v2, mask=k_mask)


def choose_block_h(num_rows: int, head_dim: int) -> int:
    """The default tile: Q/K heads (of ``num_rows``) a program rotates, a power of two.

    About 4,096 values of Q/K a program (32 heads of 128): Llama-3-8B's 40 rows are two
    programs a token. Rows are heads, so a program never splits one. (``--fused`` in
    benchmarks/kernels.py also times tiles of 8 heads: 5 programs a token, none masked.)
    """
    return min(next_power_of_2(num_rows), max(1, 4096 // head_dim))


def rope_and_store_(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim] (or [num_tokens, 1, head_dim]), qkv's dtype
    sin: torch.Tensor,  # [num_tokens, head_dim] (or [num_tokens, 1, head_dim]), qkv's dtype
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (int32 accepted), -1 = skip
    num_heads: int,
    num_kv_heads: int,
    key_offset: torch.Tensor | None = None,  # [num_kv_heads, head_dim] float32
    *,
    block_h: int | None = None,  # Q/K heads a program rotates (a power of two); None: ~4,096 values
    pdl: bool | None = None,  # a programmatic dependent launch; None: PAGEDSERVE_PDL's
) -> torch.Tensor:  # rotated queries [num_tokens, num_heads, head_dim], a view of qkv
    """Rotate Q (in place in ``qkv``) and K, store rotated K and V at ``slot_mapping``.

    Returns Q's part of ``qkv`` viewed as ``[num_tokens, num_heads, head_dim]``. K's part of
    ``qkv`` is left unrotated (only the cache holds rotated K). The cache must have the
    dtype of ``qkv`` (K and V are stored as computed, no further rounding), or be quantized
    (kernels/kv_quant.py): rotated K (less ``key_offset`` when given, Hadamard-transformed)
    and V are then quantized from those same values.
    """
    check_kv_cache(key_cache, value_cache)
    num_blocks, block_size, cache_kv_heads, head_dim = key_cache.shape
    assert cache_kv_heads == num_kv_heads, (key_cache.shape, num_kv_heads)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert head_dim % 2 == 0, head_dim
    assert qkv.dim() == 2, tuple(qkv.shape)
    num_tokens = qkv.shape[0]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim, (qkv.shape, head_dim)
    assert qkv.dtype in SUPPORTED_DTYPES, qkv.dtype
    assert qkv.dtype == key_cache.dtype or kv_quant.is_quantized(key_cache), (qkv, key_cache)
    assert qkv.stride(1) == 1, "rows of qkv must be contiguous"
    cos = cos.view(num_tokens, head_dim)
    sin = sin.view(num_tokens, head_dim)
    assert cos.dtype == sin.dtype == qkv.dtype, (cos.dtype, sin.dtype, qkv.dtype)
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
    assert slot_mapping.dtype in (torch.int32, torch.int64), slot_mapping.dtype
    assert slot_mapping.is_contiguous()
    assert qkv.device == cos.device == sin.device == key_cache.device == slot_mapping.device
    offset_ptr, has_offset = key_offset_arg(key_cache, key_offset)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return q
    num_rows = num_heads + num_kv_heads
    if block_h is None:
        block_h = choose_block_h(num_rows, head_dim)
    assert block_h >= 1 and block_h == next_power_of_2(block_h), block_h
    _rope_and_store_kernel[(num_tokens, triton.cdiv(num_rows, block_h))](
        qkv, cos, sin, key_cache, value_cache, slot_mapping, offset_ptr,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HALF_PAD=next_power_of_2(head_dim // 2), BLOCK_H=block_h, BLOCK_SIZE=block_size,
        HAS_KEY_OFFSET=has_offset,
        **round_args(_rope_and_store_kernel, qkv.dtype),
        **quant_args(_rope_and_store_kernel, key_cache),
        **pdl_args(pdl, qkv.device),
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return q
