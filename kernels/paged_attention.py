"""Triton decode paged attention: one query token per sequence, K/V read through block tables.

Import the launcher explicitly (``kernels/__init__.py`` never imports triton)::

    from kernels.paged_attention import paged_attention_decode

Same positional signature and semantics as ``kernels.reference.paged_attention_decode``.

Grid ``(num_seqs, num_kv_heads, num_splits)``. A program owns one KV head of one sequence and
*all* the query heads grouped on it (GQA): the group is the M dimension of ``tl.dot``, padded
to a power of two >= 16 and masked, so each K/V tile is loaded from memory once per group,
not once per query head. The context is walked in tiles of ``TILE_N`` tokens; each token's
block id is looked up in the block table, so tiles and blocks need not line up (any block
size works). Softmax is online (running max and sum) in float32, in base 2: that loop is
``kernels/_online_softmax.attend_context``, shared with the prefill kernel.

Split-K (flash-decoding): with few sequences, ``num_seqs * num_kv_heads`` programs cannot
fill the GPU (batch 1 of a Llama-3-8B shape is 8 programs on 132 SMs), so the context is cut
into ``num_splits`` ranges, each program writes a partial output and its log-sum-exp, and
``_reduce_splits_kernel`` merges them. The split count comes from shapes only (batch size,
KV heads, and a context bound: the block tables' width or a caller's bucket), never from
``seq_lens`` on the host, so one CUDA graph per (batch size, context bucket) stays valid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import kv_quant
from kernels._common import (
    attention_dtype,
    check_attention_inputs,
    next_power_of_2,
    num_compute_units,
)
from kernels._kv_quant_triton import hadamard_rows
from kernels._online_softmax import attend_context
from kernels._triton_common import dot_args

__all__ = ["paged_attention_decode", "choose_num_splits"]

# log2(e): scores are kept in base 2 so the kernel uses exp2 (one MUFU op) instead of exp.
_LOG2E = 1.4426950408889634
# Split-K heuristic (see choose_num_splits). A split is at least one tile: shorter, a program
# would mask most of its only tile.
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 32
# Below this many waves of programs (per SM) the plain grid is left unsplit only when it
# already fills the device: batch >= 33 at 8 KV heads on 132 SMs keeps the one-kernel path.
SPLIT_BELOW_WAVES = 2
# Split grids aim at this many programs per SM: a decode program streams its K/V tiles
# one after another, so an SM needs several resident to keep enough loads in flight.
TARGET_WAVES = 4
# Launch parameters of the decode kernel (Triton's defaults; benchmarks/kernels.py --warps and
# --stages sweep them).
NUM_WARPS = 4
NUM_STAGES = 3
TILE_N = 64  # context tokens per loop iteration
# The window of a layer without one: more keys than any context holds (int32 positions).
NO_WINDOW = 2**30


# Triton compiles a variant per value class (== 1, divisible by 16) of every integer argument
# and per 16-byte alignment of every pointer. Arguments that change from step to step (the
# split size, the strides of the split scratch, the block-table width) are not specialised:
# otherwise a server meets new variants under load and stalls a step for each compile.
@triton.jit(
    do_not_specialize=(
        "tokens_per_split", "stride_out_seq", "stride_out_head", "stride_out_split",
        "stride_lse_seq", "stride_lse_head", "stride_block_tables_seq",
    ),
)  # fmt: skip
def _paged_attention_decode_kernel(
    # no split: [num_seqs, num_heads, head_dim]
    # split:    [num_seqs, num_heads, num_splits, head_dim] fp32, normalised per split
    out_ptr,
    lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, base-2 log-sum-exp (split mode only)
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e)
    tokens_per_split,  # context tokens per split, a multiple of TILE_N
    sliding_window,  # keys a query sees (itself included); larger than any context: all
    stride_query_seq: tl.int64,
    stride_query_head: tl.int64,
    stride_out_seq: tl.int64,
    stride_out_head: tl.int64,
    stride_out_split: tl.int64,
    stride_lse_seq: tl.int64,
    stride_lse_head: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    stride_cache_head: tl.int64,
    stride_block_tables_seq: tl.int64,
    NUM_QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # >= 16 (tl.dot minimum) and a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # tl.dot operand type, see kernels/_triton_common.dot_args
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,  # 8-bit rows + a float16 scale each (kernels/kv_quant.py)
    HADAMARD_BLOCK: tl.constexpr,  # a quantized cache's keys' Hadamard blocks, else 1
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = split * tokens_per_split
    # The last split runs to the end of the context, so a context longer than the bound the
    # splits were sized for is still attended to in full.
    last = split == tl.num_programs(2) - 1
    ctx_end = tl.where(last, seq_len, tl.minimum(seq_len, ctx_start + tokens_per_split))
    # The sliding window moves the start of the keys: a split wholly before it is empty.
    ctx_start = tl.maximum(ctx_start, seq_len - sliding_window)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * NUM_QUERIES_PER_KV + offs_g  # query heads of this KV head
    g_mask = offs_g < NUM_QUERIES_PER_KV
    d_mask = offs_d < HEAD_DIM

    q_offs = seq * stride_query_seq + heads[:, None] * stride_query_head + offs_d[None, :]
    q = tl.load(query_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if QUANTIZED:
        # The cache holds H k (kernels/kv_quant.py): <q, k> = <H q, H k> / HADAMARD_BLOCK.
        q = hadamard_rows(q.to(tl.float32), GROUP_PAD, HEAD_DIM_PAD, HADAMARD_BLOCK)
        qk_scale = qk_scale * (1.0 / HADAMARD_BLOCK)
    q = q.to(DOT_DTYPE)
    # q: [GROUP_PAD, HEAD_DIM_PAD], rows past the group are zeros (finite scores, never stored)

    block_table = block_tables_ptr + seq * stride_block_tables_seq
    head_offset = kv_head.to(tl.int64) * stride_cache_head
    # Every tile holds >= 1 valid position, so m_i is finite and exp2 never sees NaN.
    # (offs_g stands in for q_pos, which only a causal walk reads.)
    m_i, l_i, acc = attend_context(
        q, offs_g, key_cache_ptr, value_cache_ptr, block_table, head_offset,
        ctx_start, ctx_end, qk_scale, 0, stride_cache_block, stride_cache_slot,
        M=GROUP_PAD, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD, BLOCK_SIZE=BLOCK_SIZE,
        TILE_N=TILE_N, CAUSAL=False, DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION,
        QUANTIZED=QUANTIZED,
    )  # fmt: skip

    # An empty split (context shorter than this split's start) or seq_len == 0 has l_i == 0:
    # write zeros and lse = -inf, which the reduction weighs by exp2(-inf) = 0.
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    o_offs = seq * stride_out_seq + heads[:, None] * stride_out_head + offs_d[None, :]
    if SPLIT:
        tl.store(out_ptr + o_offs + split * stride_out_split, out, mask=o_mask)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        lse_offs = seq * stride_lse_seq + heads * stride_lse_head + split  # splits contiguous
        tl.store(lse_ptr + lse_offs, lse, mask=g_mask)
    else:
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(
    do_not_specialize=(
        "num_splits", "stride_partial_seq", "stride_partial_head", "stride_lse_seq",
        "stride_lse_head",
    ),
)  # fmt: skip
def _reduce_splits_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32, normalised per split
    lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, base 2
    stride_out_seq: tl.int64,
    stride_out_head: tl.int64,
    stride_partial_seq: tl.int64,
    stride_partial_head: tl.int64,
    stride_partial_split: tl.int64,
    stride_lse_seq: tl.int64,
    stride_lse_head: tl.int64,
    num_splits,
    SPLITS_PAD: tl.constexpr,  # next power of two of num_splits: one variant per power
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM

    lse = tl.load(
        lse_ptr + seq * stride_lse_seq + head * stride_lse_head + offs_s,
        mask=s_mask,
        other=float("-inf"),
    )  # [SPLITS_PAD]
    # Split 0 is never empty when seq_len >= 1, so lse_max is finite; guard seq_len == 0.
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)  # [SPLITS_PAD], 0 for empty splits
    total = tl.sum(weights, 0)
    partial = tl.load(
        partial_out_ptr
        + seq * stride_partial_seq
        + head * stride_partial_head
        + offs_s[:, None] * stride_partial_split
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [SPLITS_PAD, HEAD_DIM_PAD]
    out = tl.sum(partial * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device
) -> int:
    """Split-K heuristic: split only when the plain grid underfills the device.

    The plain grid has ``num_seqs * num_kv_heads`` programs. At ``SPLIT_BELOW_WAVES`` waves
    of the device's SMs or more it is left as it is (the large-batch path streams K/V near
    HBM peak unsplit, and splitting would only add the partial outputs' traffic). Below,
    each context is cut so the grid reaches about ``TARGET_WAVES`` programs per SM, keeping
    every split at least ``MIN_TOKENS_PER_SPLIT`` tokens (one tile) and at most
    ``MAX_SPLITS`` splits (each adds one fp32 partial row per query head to write and merge).

    On an H100 (132 SMs), Llama-3-8B shape (8 KV heads): batch 1 x 512 -> 8 splits of 64
    tokens (64 programs: the context has no more tiles); 16 x 512 -> 4 of 128 (512
    programs); 1 x 4,096 -> 32 of 128 (256); 64 x 4,096 and beyond -> 1 (unchanged).

    ``max_context_len`` must come from shapes (a bucket of the batch's longest context), not
    from ``seq_lens`` read on the host. Off CUDA (the interpreter runs programs one after
    another) splitting only adds work, so this returns 1.
    """
    if device.type != "cuda":
        return 1
    num_programs = max(1, num_seqs * num_kv_heads)
    sms = num_compute_units(device)
    if num_programs >= SPLIT_BELOW_WAVES * sms:
        return 1
    by_parallelism = triton.cdiv(TARGET_WAVES * sms, num_programs)
    by_length = max_context_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(by_parallelism, by_length, MAX_SPLITS))


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, >= 1
    scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to all ``seq_lens[i]`` cached tokens, or with
    ``sliding_window`` to the last that many (``kernels.reference.sliding_window_start``).

    Requires ``seq_lens[i] <= block_tables.shape[1] * block_size`` (every context token has
    a block). ``num_splits`` forces the split-K factor (1 = no split); ``None`` lets
    ``choose_num_splits`` decide. Splits are sized for contexts up to ``max_context_len``
    (default ``block_tables.shape[1] * block_size``); the launcher never reads ``seq_lens``
    on the host (no device sync), and grid and scratch buffers depend only on shapes and
    these two integers, so the call can be captured in a CUDA graph (the partial outputs
    are then allocated from the graph's pool). A captured graph padded to a fixed
    block-table width should pass its context bucket as ``max_context_len``; a sequence
    longer than that is still attended to in full (the last split runs to the end of its
    context), only with less parallelism.
    """
    check_attention_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert seq_lens.shape == (num_seqs,), "one query token per sequence"

    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, query.device)
    assert num_splits >= 1, num_splits
    # Splits are whole tiles (at least one, even for an empty block table); recount so that
    # no split starts past the context bound.
    tokens_per_split = max(
        TILE_N, triton.cdiv(triton.cdiv(max_context_len, num_splits), TILE_N) * TILE_N
    )
    num_splits = max(1, triton.cdiv(max_context_len, tokens_per_split))

    group = num_heads // num_kv_heads
    head_dim_pad = next_power_of_2(head_dim)
    consts = dict(
        NUM_QUERIES_PER_KV=group,
        GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, head_dim_pad),
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        # A quantized cache's values multiply in the query's dtype (kernels/kv_quant.py).
        **dot_args(_paged_attention_decode_kernel, attention_dtype(query, key_cache)),
        QUANTIZED=kv_quant.is_quantized(key_cache),
        HADAMARD_BLOCK=(
            kv_quant.hadamard_block(head_dim) if kv_quant.is_quantized(key_cache) else 1
        ),
    )
    common = (query, key_cache, value_cache, block_tables, seq_lens, scale * _LOG2E)
    window = NO_WINDOW if sliding_window is None else sliding_window
    assert 1 <= window <= NO_WINDOW, sliding_window
    grid = (num_seqs, num_kv_heads, num_splits)
    if num_splits == 1:
        _paged_attention_decode_kernel[grid](
            out, out, *common, tokens_per_split, window,
            query.stride(0), query.stride(1),
            out.stride(0), out.stride(1), 0,
            0, 0,
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            block_tables.stride(0),
            SPLIT=False, num_warps=NUM_WARPS, num_stages=NUM_STAGES, **consts,
        )  # fmt: skip
        return out

    # [num_seqs, num_heads, num_splits, head_dim]: fp32 so merging splits loses nothing.
    partial = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
    )
    lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    _paged_attention_decode_kernel[grid](
        partial, lse, *common, tokens_per_split, window,
        query.stride(0), query.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        SPLIT=True, num_warps=NUM_WARPS, num_stages=NUM_STAGES, **consts,
    )  # fmt: skip
    _reduce_splits_kernel[(num_seqs, num_heads)](
        out, partial, lse,
        out.stride(0), out.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        num_splits,
        SPLITS_PAD=next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
    )  # fmt: skip
    return out


def compile_variants(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    num_heads: int,
    scale: float,
    query_dtype: torch.dtype,
) -> int:
    """Compile every variant ``paged_attention_decode`` can meet with these caches and
    queries of ``query_dtype`` (the model's dtype; the cache may hold 8-bit rows): unsplit,
    and split with each power-of-two bound on the split count. Runs one sequence of one
    token over block 0 (the caches are only read). Returns the number of calls made."""
    _, block_size, _, head_dim = key_cache.shape
    device = key_cache.device
    query = torch.zeros((1, num_heads, head_dim), dtype=query_dtype, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    # 1 (unsplit), then the least count of each power-of-two bound: 2, 3, 5, 9, 17.
    counts = [1] + [2**i // 2 + 1 for i in range(1, MAX_SPLITS.bit_length())]
    for num_splits in counts:
        context = num_splits * TILE_N
        width = triton.cdiv(context, block_size)
        tables = torch.zeros((1, width), dtype=torch.int32, device=device)
        paged_attention_decode(
            query, key_cache, value_cache, tables, seq_lens, scale,
            num_splits=num_splits, max_context_len=context,
        )  # fmt: skip
    return len(counts)
