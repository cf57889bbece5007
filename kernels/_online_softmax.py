"""The online-softmax loop over a paged context, shared by the decode and prefill kernels.

``attend_context`` is a ``@triton.jit`` device function: Triton inlines it into each kernel
that calls it, so both kernels compile to what they did with the loop written out. It walks
context positions ``[start, end)`` in tiles of ``TILE_N`` tokens, looks each token's block up
in the block table (tiles and blocks need not line up), and keeps the softmax online (running
max and sum) in float32, in base 2 (``qk_scale`` includes log2(e), so it uses exp2)::

    context  | tile 0 | tile 1 | ... | tile k (partial, masked) |
             start                                            end

The caller normalises ``acc`` by ``l_i`` (and handles rows that saw nothing).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels._kv_quant_triton import scale_ptrs

__all__ = ["attend_context"]


@triton.jit
def attend_context(
    q,  # [M, HEAD_DIM_PAD] DOT_DTYPE; masked rows are zeros (finite scores, never stored)
    q_pos,  # [M] each row's query position; read only when CAUSAL
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table,  # pointer to this sequence's row of block_tables, [max_num_blocks_per_seq]
    head_offset,  # kv_head * stride_cache_head, int64
    start,  # first context position to attend to
    end,  # one past the last
    qk_scale,  # softmax scale * log2(e)
    sliding_window,  # CAUSAL only: row r also needs n > q_pos[r] - sliding_window (>= 1)
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    M: tl.constexpr,  # rows of q
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # row r sees position n only if n <= q_pos[r]
    DOT_DTYPE: tl.constexpr,  # tl.dot operand type, see kernels/_triton_common.dot_args
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,  # 8-bit rows + a float16 scale each (kernels/kv_quant.py)
    EARLY_V: tl.constexpr = False,  # issue each tile's V load beside its K load (below)
    first_tile=0,  # FIRST_IDS: the tile whose ids are given starts here, <= start
    first_ids=0,  # FIRST_IDS: [TILE_N] the block ids of positions first_tile + [0, TILE_N)
    FIRST_IDS: tl.constexpr = False,  # the ids of the walk's first tile are given (below)
):
    """Returns ``(m_i, l_i, acc)``: per row the running max (base 2), the sum of exp2 and
    the unnormalised output ``[M, HEAD_DIM_PAD]``, all float32. A row that saw no position
    (an empty range) has ``l_i == 0`` and ``m_i == -inf``.

    A quantized cache is de-quantized on the fly: its 8-bit values are exact in any
    ``DOT_DTYPE``, so the scores are ``(q . k_q) * k_scale`` (the caller passes the
    Hadamard-transformed query and folds 1 / HADAMARD_BLOCK into ``qk_scale``) and the
    values' scale folds into the probabilities, ``(p * v_scale) . v_q``.

    ``EARLY_V`` issues a tile's V load right after its K load, before the scores, so that
    both are in flight at once: without a software pipeline (``num_stages=1``) the V load
    otherwise waits for the scores, one more memory round trip per tile, which is most of
    a short split's time (one or two tiles). It holds the V tile in registers through the
    softmax; the arithmetic is the same either way.

    ``FIRST_IDS``: the caller has loaded the block ids of the tile at ``first_tile`` (the
    decode kernel, in the same memory round trip as the sequence's length, which ``start``
    and ``end`` need). Where ``start == first_tile`` that tile is the walk's first; where a
    sliding window moved ``start`` past it, the tile is masked whole (it reads nothing, and
    an all-masked tile leaves the running state as it found it: max -inf, sums 0) and the
    walk starts at ``start`` as without it. Either way the tiles, and every bit of the
    result, are the plain walk's.

    NOTE: a row that has seen no visible position yet (a sliding window starting past
    this tile) keeps ``m_i == -inf``; the tile's max is then taken as 0 for the exponents,
    so they are exp2(-inf) = 0 and never exp2(-inf - -inf) = NaN.
    """
    offs_t = tl.arange(0, TILE_N)
    m_i = tl.full([M], float("-inf"), tl.float32)  # running max (base 2)
    l_i = tl.zeros([M], tl.float32)  # running sum of exp2
    acc = tl.zeros([M, HEAD_DIM_PAD], tl.float32)
    if FIRST_IDS:
        first_live = start == first_tile  # no sliding window moved the walk's start
        offs_n = first_tile + offs_t
        first_end = tl.where(first_live, end, first_tile)  # masked whole where not live
        m_i, l_i, acc = _attend_tile(
            q, q_pos, m_i, l_i, acc, offs_n, offs_n < first_end, first_ids,
            key_cache_ptr, value_cache_ptr, head_offset, qk_scale, sliding_window,
            stride_cache_block, stride_cache_slot, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
            BLOCK_SIZE=BLOCK_SIZE, CAUSAL=CAUSAL, DOT_DTYPE=DOT_DTYPE,
            DOT_PRECISION=DOT_PRECISION, QUANTIZED=QUANTIZED, EARLY_V=EARLY_V,
        )  # fmt: skip
        start = tl.where(first_live, start + TILE_N, start)
    for tile_start in range(start, end, TILE_N):
        offs_n = tile_start + offs_t  # context positions of this tile
        n_mask = offs_n < end
        # NOTE: masked positions never dereference the cache: slots past seq_len may hold
        # garbage (even NaN) and block-table padding may be any id.
        block_ids = tl.load(block_table + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        m_i, l_i, acc = _attend_tile(
            q, q_pos, m_i, l_i, acc, offs_n, n_mask, block_ids,
            key_cache_ptr, value_cache_ptr, head_offset, qk_scale, sliding_window,
            stride_cache_block, stride_cache_slot, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
            BLOCK_SIZE=BLOCK_SIZE, CAUSAL=CAUSAL, DOT_DTYPE=DOT_DTYPE,
            DOT_PRECISION=DOT_PRECISION, QUANTIZED=QUANTIZED, EARLY_V=EARLY_V,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _attend_tile(
    q,  # [M, HEAD_DIM_PAD] DOT_DTYPE
    q_pos,  # [M]; read only when CAUSAL
    m_i,  # [M] running max (base 2)
    l_i,  # [M] running sum of exp2
    acc,  # [M, HEAD_DIM_PAD] unnormalised output
    offs_n,  # [TILE_N] the tile's context positions
    n_mask,  # [TILE_N] the positions attended to; the others are never read from the cache
    block_ids,  # [TILE_N] each position's block (any value where masked)
    key_cache_ptr,
    value_cache_ptr,
    head_offset,
    qk_scale,
    sliding_window,
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
    EARLY_V: tl.constexpr,
):
    """One tile of ``attend_context``: its K and V rows loaded, the online softmax moved on.
    Returns the new ``(m_i, l_i, acc)``."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    # int64: block_id * stride_cache_block passes 2**31 in a large pool.
    kv_offs = (
        block_ids.to(tl.int64) * stride_cache_block
        + (offs_n % BLOCK_SIZE) * stride_cache_slot
        + head_offset
    )  # [TILE_N]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    row_offs = kv_offs[:, None] + offs_d[None, :]  # [TILE_N, HEAD_DIM_PAD], K's and V's
    k = tl.load(key_cache_ptr + row_offs, mask=kv_mask, other=0.0)
    if EARLY_V:
        v = tl.load(value_cache_ptr + row_offs, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    if QUANTIZED:
        k_scale = tl.load(scale_ptrs(key_cache_ptr + kv_offs, HEAD_DIM), mask=n_mask, other=0.0).to(
            tl.float32
        )
        s = s * k_scale[None, :]
    s = s * qk_scale  # [M, TILE_N]
    if CAUSAL:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        visible = visible & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
    else:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if not EARLY_V:
        v = tl.load(value_cache_ptr + row_offs, mask=kv_mask, other=0.0)
    if QUANTIZED:
        v_scale = tl.load(
            scale_ptrs(value_cache_ptr + kv_offs, HEAD_DIM), mask=n_mask, other=0.0
        ).to(tl.float32)
        pv = (p * v_scale[None, :]).to(DOT_DTYPE)
    else:
        pv = p.to(v.dtype).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(pv, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return m_new, l_i, acc
