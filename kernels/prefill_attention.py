"""Triton prefill / extend paged attention: a chunk of queries per sequence, causal, paged K/V.

Import the launcher explicitly (``kernels/__init__.py`` never imports triton)::

    from kernels.prefill_attention import paged_attention_prefill

Same signature and semantics as ``kernels.reference.paged_attention_prefill``: sequence ``i``'s
``q_len`` queries are the last ``q_len`` of its ``seq_len`` context tokens, and their K/V are
already in the cache (``store_kv`` ran first). This covers a whole prompt (no prefix), a
chunk of a long prompt (chunked prefill), a prompt whose prefix blocks are shared (prefix
caching), and a decode token (``q_len == 1``)::

    context:  |<------ cached prefix ------>|<--- this chunk (q_len) --->|
              0                         prefix_len                    seq_len

Grid ``(num_tokens // BLOCK_Q + num_seqs, num_kv_heads)``: the first axis enumerates
"query blocks" of ``BLOCK_Q`` queries; sequence ``i``'s blocks start at index
``query_start_loc[i] // BLOCK_Q + i`` and a program finds its sequence by binary search, so
the grid depends only on tensor shapes (no host sync to learn the longest chunk). Surplus
programs return at once.

GQA: a program owns ``BLOCK_Q`` queries times every query head of one KV head, flattened into
the ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows of ``tl.dot`` (row = query * GROUP_PAD + head), so
each K/V tile is loaded once for the whole group. ``GROUP_PAD`` is the group size rounded up
to a power of two (SmolLM2's 3 query heads per KV head use 4 rows; the 4th is masked).

The loop over the context (paged K/V tiles, causal mask, online softmax) is
``kernels/_online_softmax.attend_context``, shared with the decode kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import kv_quant
from kernels._common import (
    attention_dtype,
    check_attention_inputs,
    check_out,
)
from kernels._kv_quant_triton import hadamard_rows
from kernels._online_softmax import attend_context
from kernels._triton_common import dot_args
from kernels.settings import next_power_of_2

__all__ = ["paged_attention_prefill"]

_LOG2E = 1.4426950408889634  # scores in base 2, so the kernel uses exp2
BLOCK_M = 64  # rows (query x grouped head) per program
TILE_N = 64  # context tokens per loop iteration
NO_WINDOW = 2**30  # the window of a layer without one: more keys than any context holds


@triton.jit
def _find_seq(
    query_start_loc_ptr,  # [num_seqs + 1] int32
    q_block,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """The sequence owning global query block ``q_block``: the last ``i`` whose first block
    ``query_start_loc[i] // BLOCK_Q + i`` is <= ``q_block`` (strictly increasing in ``i``)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Not specialised (see kernels/paged_attention.py): the batch's sequence count and
# block-table width change every step, and a mixed step passes the prefill rows' block
# tables and lengths as views at an offset whose alignment changes with the decode count.
@triton.jit(
    do_not_specialize=("num_seqs", "stride_block_tables_seq"),
    do_not_specialize_on_alignment=("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"),
)
def _paged_attention_prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks_per_seq] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e)
    sliding_window,  # keys a query sees (itself included); larger than any context: all
    num_seqs,
    stride_query_token: tl.int64,
    stride_query_head: tl.int64,
    stride_out_token: tl.int64,
    stride_out_head: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    stride_cache_head: tl.int64,
    stride_block_tables_seq: tl.int64,
    NUM_QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # next power of two of NUM_QUERIES_PER_KV
    BLOCK_Q: tl.constexpr,  # queries per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD, >= 16
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # tl.dot operand type, see kernels/_triton_common.dot_args
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,  # 8-bit rows + a float16 scale each (kernels/kv_quant.py)
    HADAMARD_BLOCK: tl.constexpr,  # a quantized cache's keys' Hadamard blocks, else 1
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:  # surplus program of this sequence
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_block_local * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] query within the chunk
    group_idx = offs_m % GROUP_PAD
    heads = kv_head * NUM_QUERIES_PER_KV + group_idx
    row_mask = (q_idx < q_len) & (group_idx < NUM_QUERIES_PER_KV)
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix_len + q_idx  # [BLOCK_M] position of each row's query in the context

    tokens = (q_start + q_idx).to(tl.int64)
    q_offs = tokens[:, None] * stride_query_token + heads[:, None] * stride_query_head
    q = tl.load(
        query_ptr + q_offs + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0
    )  # [BLOCK_M, HEAD_DIM_PAD]; masked rows are zeros, computed but never stored
    if QUANTIZED:
        # The cache holds H k (kernels/kv_quant.py): <q, k> = <H q, H k> / HADAMARD_BLOCK.
        q = hadamard_rows(q.to(tl.float32), BLOCK_M, HEAD_DIM_PAD, HADAMARD_BLOCK)
        qk_scale = qk_scale * (1.0 / HADAMARD_BLOCK)
    q = q.to(DOT_DTYPE)

    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    head_offset = kv_head.to(tl.int64) * stride_cache_head
    # Keys past the last query of this block are invisible to all its rows: stop there.
    kv_end = tl.minimum(seq_len, prefix_len + (q_block_local + 1) * BLOCK_Q)
    # Keys before the window of this block's first query are invisible to all its rows.
    kv_start = tl.maximum(0, prefix_len + q_block_local * BLOCK_Q - sliding_window + 1)
    # Every valid row sees itself; a masked row may see nothing (l_i == 0), never stored.
    m_i, l_i, acc = attend_context(
        q, q_pos, key_cache_ptr, value_cache_ptr, block_table, head_offset,
        kv_start, kv_end, qk_scale, sliding_window, stride_cache_block, stride_cache_slot,
        M=BLOCK_M, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD, BLOCK_SIZE=BLOCK_SIZE,
        TILE_N=TILE_N, CAUSAL=True, DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION,
        QUANTIZED=QUANTIZED,
    )  # fmt: skip

    out = acc / l_i[:, None]
    o_offs = tokens[:, None] * stride_out_token + heads[:, None] * stride_out_head
    tl.store(
        out_ptr + o_offs + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_attention_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """A chunk of query tokens per sequence, attending causally over its paged context (with
    ``sliding_window``, each query over the last that many keys up to itself).

    Requires ``seq_lens[i] >= q_len_i``; sequences with ``q_len == 0`` are allowed and
    produce nothing. Query rows not covered by ``query_start_loc`` are left unwritten.
    ``out`` (shaped like ``query``, any row and head strides): written and returned instead
    of a new tensor.
    """
    check_attention_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_seqs + 1,), (query_start_loc.shape, num_seqs)
    assert query_start_loc.dtype == torch.int32, query_start_loc.dtype
    assert query_start_loc.is_contiguous()
    assert query_start_loc.device == query.device

    out = check_out(out, query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_q = max(1, BLOCK_M // group_pad)
    # Each sequence wastes at most one partial query block, hence "+ num_seqs".
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        scale * _LOG2E, NO_WINDOW if sliding_window is None else sliding_window, num_seqs,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_q * group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        # A quantized cache's values multiply in the query's dtype (kernels/kv_quant.py).
        **dot_args(_paged_attention_prefill_kernel, attention_dtype(query, key_cache)),
        QUANTIZED=kv_quant.is_quantized(key_cache),
        HADAMARD_BLOCK=(
            kv_quant.hadamard_block(head_dim) if kv_quant.is_quantized(key_cache) else 1
        ),
    )  # fmt: skip
    return out
