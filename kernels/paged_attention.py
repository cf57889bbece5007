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

One-launch split-K (``one_launch=True``): the splits still write partials and log-sum-exps,
then take a ticket from an int32 arrival counter per (sequence, KV head); the last to
arrive resets its counter and merges in the same launch (no second kernel, no program ever
waits). The counters live in one persistent zeroed buffer per device
(``_triton_common.arrival_counters``) that the kernel keeps zero, so CUDA-graph replays need
no host-side fill.

Latency at short contexts (``DecodeLaunch.prefetch_ids``, ``DecodeLaunch.pdl``): a split
of one or two tiles is a chain of dependent memory round trips (the sequence's length, then
its block ids, then K and V, then the partial's store, then the merge kernel's loads), each
as long as the tile's whole transfer. ``prefetch_ids`` loads the first tile's block ids in
the same round trip as the length. ``pdl`` launches both kernels as programmatic dependent
launches (Hopper and later): a kernel may start while the one before it in the stream
finishes, loads the length and block ids, and waits (``gdc_wait``) only before the first
load of what that kernel may have written (the query, K and V just stored, the partials).

The launch (split policy, merge, ``num_warps``, ``num_stages``, tile, the two above) comes
from the table ``DECODE_TUNING`` (``choose_launch``), which ``python -m benchmarks.kernels
--sweep`` fills; ``PAGEDSERVE_ATTENTION_TUNING`` adds a swept table's rows before it
(kernels/attention_tuning.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels import kv_quant
from kernels._common import (
    attention_dtype,
    check_attention_inputs,
    check_out,
    num_compute_units,
)
from kernels._kv_quant_triton import hadamard_rows
from kernels._online_softmax import attend_context
from kernels._triton_common import (
    arrival_counters,
    dot_args,
    last_to_arrive,
    pdl_args,
    pdl_enter,
    pdl_policy,
    pdl_supported,
)
from kernels.attention_tuning import DecodeTuning, attention_tuning_env
from kernels.settings import next_power_of_2

__all__ = [
    "DECODE_TUNING",
    "DecodeLaunch",
    "DecodeTuning",
    "choose_launch",
    "choose_num_splits",
    "paged_attention_decode",
    "pdl_supported",
    "with_pdl_policy",
]

# log2(e): scores are kept in base 2 so the kernel uses exp2 (one MUFU op) instead of exp.
_LOG2E = 1.4426950408889634
# Split-K heuristic (see choose_num_splits and DECODE_TUNING). A split is at least one tile:
# shorter, a program would mask most of its only tile.
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 32
# Below this many waves of programs (per SM) the plain grid is left unsplit only when it
# already fills the device: batch >= 33 at 8 KV heads on 132 SMs keeps the one-kernel path.
SPLIT_BELOW_WAVES = 2
# Split grids aim at this many programs per SM: a decode program streams its K/V tiles
# one after another, so an SM needs several resident to keep enough loads in flight.
TARGET_WAVES = 4
# Launch parameters of the decode kernel (Triton's defaults; `python -m benchmarks.kernels
# --sweep` times the alternatives).
NUM_WARPS = 4
NUM_STAGES = 3
TILE_N = 64  # context tokens per loop iteration
# The window of a layer without one: more keys than any context holds (int32 positions).
NO_WINDOW = 2**30
# A context bound larger than any (the catch-all row of DECODE_TUNING).
ANY_CONTEXT = 2**31


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    """How one ``paged_attention_decode`` call runs: what the tuning sweep varies."""

    num_splits: int = 1  # split-K factor before the launcher's recount (1 = no split)
    # Split-K merged in the same launch by the last split of each (sequence, KV head), with
    # an arrival counter; False: the splits' partials are merged by a second kernel.
    one_launch: bool = False
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES
    tile_n: int = TILE_N  # context tokens per loop iteration; splits are whole tiles
    # Each tile's V load issued beside its K load (kernels/_online_softmax.attend_context).
    early_v: bool = False
    # The first tile's block ids loaded beside the sequence's length, not after it.
    prefetch_ids: bool = False
    # Both kernels launched as programmatic dependent launches (needs prefetch_ids: the ids
    # and the length are what a kernel loads before it waits; see pdl_supported).
    pdl: bool = False


# NOTE: where these numbers come from. The first three rows are `python -m benchmarks.kernels
# --sweep`'s best launches on one H100 (benchmarks/RESULTS.md, "Kernels"); there the
# two-launch merge beat the one-launch merge at every split count (the last split's merge
# waits on the slowest split). The catch-all rows keep the values measured before the sweep
# (split below 2 waves, toward 4 waves, splits of >= 64 tokens, <= 32 splits, 4 warps, 3
# stages, 64-token tiles): the sweep found nothing faster for long contexts. To tune for
# another device, run the sweep with --write-tuning FILE and serve with
# PAGEDSERVE_ATTENTION_TUNING=FILE, or put its lines before the catch-all rows, most specific
# first. The last row must cover every call.
DECODE_TUNING: tuple[DecodeTuning, ...] = (
    # Measured on one H100 (`--sweep`, bf16, 32 query / 8 KV heads, head_dim 128, block 16):
    # the best launch of each short-context row of the issue, most specific first.
    DecodeTuning(
        waves_below=0.061, max_context_len=512, target_waves=0.97, min_tokens_per_split=32,
        max_splits=16, one_launch=False, num_warps=4, num_stages=2, tile_n=32,
    ),  # 1 x 512
    DecodeTuning(
        waves_below=0.97, max_context_len=512, target_waves=3.879, min_tokens_per_split=64,
        max_splits=4, one_launch=False, num_warps=4, num_stages=1, tile_n=64,
    ),  # 16 x 512
    DecodeTuning(
        waves_below=0.061, max_context_len=4096, target_waves=1.94, min_tokens_per_split=128,
        max_splits=32, one_launch=False, num_warps=8, num_stages=1, tile_n=128,
    ),  # 1 x 4096
    # The unsplit grid underfills the device: split-K.
    DecodeTuning(
        waves_below=SPLIT_BELOW_WAVES, max_context_len=ANY_CONTEXT, target_waves=TARGET_WAVES,
        min_tokens_per_split=MIN_TOKENS_PER_SPLIT, max_splits=MAX_SPLITS, one_launch=False,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, tile_n=TILE_N,
    ),
    # It fills it: one program per (sequence, KV head), streaming K/V near HBM peak.
    DecodeTuning(
        waves_below=math.inf, max_context_len=ANY_CONTEXT, target_waves=0,
        min_tokens_per_split=MIN_TOKENS_PER_SPLIT, max_splits=1, one_launch=False,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, tile_n=TILE_N,
    ),
)  # fmt: skip


# Triton compiles a variant per value class (== 1, divisible by 16) of every integer argument
# and per 16-byte alignment of every pointer. Arguments that change from step to step (the
# split size, the strides of the split scratch, the block-table width) are not specialised:
# otherwise a server meets new variants under load and stalls a step for each compile.
@triton.jit(
    do_not_specialize=(
        "tokens_per_split", "stride_out_seq", "stride_out_head", "stride_out_split",
        "stride_lse_seq", "stride_lse_head", "stride_block_tables_seq", "max_blocks_per_seq",
    ),
)  # fmt: skip
def _paged_attention_decode_kernel(
    # no split: [num_seqs, num_heads, head_dim]
    # split:    [num_seqs, num_heads, num_splits, head_dim] fp32, normalised per split
    out_ptr,
    lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, base-2 log-sum-exp (split mode only)
    final_out_ptr,  # [num_seqs, num_heads, head_dim] (COMBINE only)
    counters_ptr,  # [num_seqs, num_kv_heads] int32, zero between launches (COMBINE only)
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e)
    tokens_per_split,  # context tokens per split, a multiple of TILE_N
    sliding_window,  # keys a query sees (itself included); larger than any context: all
    max_blocks_per_seq,  # block_tables.shape[1]: where PREFETCH_IDS may read up to
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
    stride_final_seq: tl.int64,
    stride_final_head: tl.int64,
    NUM_QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # >= 16 (tl.dot minimum) and a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    COMBINE: tl.constexpr,  # SPLIT only: the last split of a (sequence, KV head) merges all
    SPLITS_PAD: tl.constexpr,  # COMBINE: next power of two of num_splits, else 1
    DOT_DTYPE: tl.constexpr,  # tl.dot operand type, see kernels/_triton_common.dot_args
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,  # 8-bit rows + a float16 scale each (kernels/kv_quant.py)
    HADAMARD_BLOCK: tl.constexpr,  # a quantized cache's keys' Hadamard blocks, else 1
    EARLY_V: tl.constexpr,  # DecodeLaunch.early_v
    PREFETCH_IDS: tl.constexpr,  # DecodeLaunch.prefetch_ids
    PDL: tl.constexpr,  # DecodeLaunch.pdl: launched as a programmatic dependent launch
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    block_table = block_tables_ptr + seq * stride_block_tables_seq
    seq_len = tl.load(seq_lens_ptr + seq)
    first_tile = split * tokens_per_split
    if PREFETCH_IDS:
        # The split's first tile's block ids, not waiting for seq_len: masked to the table's
        # width only (ids past the context are read but never dereferenced).
        first_blocks = (first_tile + tl.arange(0, TILE_N)) // BLOCK_SIZE
        first_ids = tl.load(
            block_table + first_blocks, mask=first_blocks < max_blocks_per_seq, other=0
        )
    else:
        first_ids = 0
    # NOTE: with PDL, what is loaded above is read before the kernel before has finished.
    # seq_lens and block_tables are inputs of the step, written before it starts (or by a
    # kernel at least two launches back, complete once this kernel launches); the query
    # and the K/V just stored may come from the kernel before, so every load of them
    # follows the wait.
    pdl_enter(PDL)
    ctx_start = first_tile
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

    head_offset = kv_head.to(tl.int64) * stride_cache_head
    # Every tile holds >= 1 valid position, so m_i is finite and exp2 never sees NaN.
    # (offs_g stands in for q_pos, which only a causal walk reads.)
    m_i, l_i, acc = attend_context(
        q, offs_g, key_cache_ptr, value_cache_ptr, block_table, head_offset,
        ctx_start, ctx_end, qk_scale, 0, stride_cache_block, stride_cache_slot,
        M=GROUP_PAD, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD, BLOCK_SIZE=BLOCK_SIZE,
        TILE_N=TILE_N, CAUSAL=False, DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION,
        QUANTIZED=QUANTIZED, EARLY_V=EARLY_V, first_tile=first_tile, first_ids=first_ids,
        FIRST_IDS=PREFETCH_IDS,
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
        lse_offs = seq * stride_lse_seq + heads * stride_lse_head  # splits contiguous
        tl.store(lse_ptr + lse_offs + split, lse, mask=g_mask)
        if COMBINE:
            # The last split of the (sequence, KV head) to store its partial and lse merges.
            counter = counters_ptr + seq * tl.num_programs(1) + kv_head
            if last_to_arrive(counter, tl.num_programs(2)):
                # Each query head of the group merges its splits as the second kernel
                # would (unrolled: the heads' loads are independent, one L2 round trip).
                offs_s = tl.arange(0, SPLITS_PAD)
                for g in tl.static_range(NUM_QUERIES_PER_KV):
                    head = kv_head.to(tl.int64) * NUM_QUERIES_PER_KV + g
                    _merge_head(
                        final_out_ptr + seq * stride_final_seq + head * stride_final_head,
                        out_ptr + seq * stride_out_seq + head * stride_out_head,
                        lse_ptr + seq * stride_lse_seq + head * stride_lse_head,
                        offs_s, offs_d, tl.num_programs(2), stride_out_split,
                        HEAD_DIM=HEAD_DIM, CACHE=".cg",
                    )  # fmt: skip
    else:
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_head(
    out_ptr,  # the head's output row, [head_dim]
    partial_ptr,  # the head's split 0 partial row, fp32, normalised per split
    lse_ptr,  # the head's split 0 lse, fp32 base 2 (splits contiguous)
    offs_s,  # [SPLITS_PAD] split indices
    offs_d,  # [HEAD_DIM_PAD]
    num_splits,
    stride_partial_split,
    HEAD_DIM: tl.constexpr,
    CACHE: tl.constexpr,  # load cache modifier: ".cg" where other SMs wrote this launch
):
    """One query head's split-K merge: each split's normalised partial weighted by
    ``exp2(lse_s - max lse)``. Both merges (second kernel, in-launch) run this same code."""
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + offs_s, mask=s_mask, other=float("-inf"), cache_modifier=CACHE)
    partial = tl.load(
        partial_ptr + offs_s[:, None] * stride_partial_split + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
        cache_modifier=CACHE,
    )  # [SPLITS_PAD, HEAD_DIM_PAD]
    # Split 0 is never empty when seq_len >= 1, so lse_max is finite; guard seq_len == 0.
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)  # [SPLITS_PAD], 0 for empty splits
    total = tl.sum(weights, 0)
    out = tl.sum(partial * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


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
    PDL: tl.constexpr,  # launched as a programmatic dependent launch of the split kernel
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    pdl_enter(PDL)  # the partials are the kernel before's
    _merge_head(
        out_ptr + seq * stride_out_seq + head * stride_out_head,
        partial_out_ptr + seq * stride_partial_seq + head * stride_partial_head,
        lse_ptr + seq * stride_lse_seq + head * stride_lse_head,
        tl.arange(0, SPLITS_PAD), tl.arange(0, HEAD_DIM_PAD), num_splits, stride_partial_split,
        HEAD_DIM=HEAD_DIM, CACHE="",
    )  # fmt: skip


def decode_tuning(
    *, head_dim: int | None = None, kv_dtype: torch.dtype | None = None
) -> tuple[DecodeTuning, ...]:
    """The rows ``choose_launch`` reads for a cache of ``head_dim`` and ``kv_dtype``:
    ``DECODE_TUNING``, with the rows for that cache of the table
    ``PAGEDSERVE_ATTENTION_TUNING`` names in their places (kernels/attention_tuning.py;
    where the cache is not given, only the table's rows for any)."""
    table = attention_tuning_env()
    if table is None:
        return DECODE_TUNING
    name = None if kv_dtype is None else str(kv_dtype).removeprefix("torch.")
    return table.rows(DECODE_TUNING, head_dim, name)


def tuning_row(
    num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device, *,
    head_dim: int | None = None, kv_dtype: torch.dtype | None = None,
) -> DecodeTuning:  # fmt: skip
    """The first row of ``decode_tuning()`` that covers these shapes."""
    programs_per_sm = max(1, num_seqs * num_kv_heads) / num_compute_units(device)
    for row in decode_tuning(head_dim=head_dim, kv_dtype=kv_dtype):
        if programs_per_sm < row.waves_below and max_context_len <= row.max_context_len:
            return row
    raise AssertionError("the last row of DECODE_TUNING must cover every call")


def choose_launch(
    num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device, *,
    head_dim: int | None = None, kv_dtype: torch.dtype | None = None,
) -> DecodeLaunch:  # fmt: skip
    """The launch ``paged_attention_decode`` uses for these shapes (``decode_tuning()``:
    ``DECODE_TUNING``, and a swept table's rows where ``PAGEDSERVE_ATTENTION_TUNING`` names
    one).

    Split-K only where the plain grid underfills the device: the plain grid has
    ``num_seqs * num_kv_heads`` programs; a row that splits cuts each context so the grid
    reaches about ``target_waves`` programs per SM, keeping every split at least
    ``min_tokens_per_split`` tokens and at most ``max_splits`` splits (each adds one fp32
    partial row per query head to write and merge).

    On an H100 (132 SMs), Llama-3-8B shape (8 KV heads), with today's table: batch 1 x 512
    -> 8 splits of 64 tokens (64 programs: the context has no more tiles); 16 x 512 -> 4 of
    128 (512 programs); 1 x 4,096 -> 32 of 128 (256); 64 x 4,096 and beyond -> 1.

    ``max_context_len`` must come from shapes (a bucket of the batch's longest context), not
    from ``seq_lens`` read on the host. Off CUDA (the interpreter runs programs one after
    another) splitting only adds work, so the split count is 1 there. ``head_dim`` and
    ``kv_dtype`` (the cache's) choose which rows of a swept table apply; without them, only
    its rows for any cache.
    """
    row = tuning_row(
        num_seqs, num_kv_heads, max_context_len, device, head_dim=head_dim, kv_dtype=kv_dtype
    )
    num_splits = 1
    if device.type == "cuda" and row.target_waves > 0:
        sms = num_compute_units(device)
        by_parallelism = math.ceil(row.target_waves * sms / max(1, num_seqs * num_kv_heads))
        by_length = max_context_len // row.min_tokens_per_split
        num_splits = max(1, min(by_parallelism, by_length, row.max_splits))
    launch = DecodeLaunch(
        num_splits, row.one_launch, row.num_warps, row.num_stages, row.tile_n, row.early_v,
        row.prefetch_ids, row.pdl,
    )  # fmt: skip
    return with_pdl_policy(launch, device)


def with_pdl_policy(launch: DecodeLaunch, device: torch.device) -> DecodeLaunch:
    """``launch`` as ``device`` runs it: a row's ``pdl`` only where supported
    (``pdl_supported``); ``PAGEDSERVE_PDL=1`` turns it on (with ``prefetch_ids``, what a
    dependent launch loads before it waits) and ``=0`` off (``pdl_policy``)."""
    policy = pdl_policy(device)
    if policy is None:
        return replace(launch, pdl=launch.pdl and pdl_supported(device))
    if policy:
        return replace(launch, prefetch_ids=True, pdl=True)
    return replace(launch, pdl=False)


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device, *,
    head_dim: int | None = None, kv_dtype: torch.dtype | None = None,
) -> int:  # fmt: skip
    """The split-K factor of ``choose_launch`` (before the launcher rounds splits to whole
    tiles and recounts them)."""
    return choose_launch(
        num_seqs, num_kv_heads, max_context_len, device, head_dim=head_dim, kv_dtype=kv_dtype
    ).num_splits


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
    one_launch: bool | None = None,
    launch: DecodeLaunch | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to all ``seq_lens[i]`` cached tokens, or with
    ``sliding_window`` to the last that many (transformers' window: the query at position
    ``p`` sees keys ``p - sliding_window < k <= p``).

    Requires ``seq_lens[i] <= block_tables.shape[1] * block_size`` (every context token has
    a block). The launch comes from ``choose_launch`` (``decode_tuning()``); ``num_splits``
    forces its split-K factor (1 = no split), ``one_launch`` its merge (True: the last
    split merges in the same launch; False: a second kernel merges), and ``launch`` replaces
    it whole (then neither may be given). Splits are sized for contexts up to
    ``max_context_len`` (default ``block_tables.shape[1] * block_size``); the launcher never
    reads ``seq_lens`` on the host (no device sync), and grid and scratch buffers depend
    only on shapes and these integers, so the call can be captured in a CUDA graph (the
    partial outputs are then allocated from the graph's pool; the one-launch path's
    arrival counters are persistent, see ``arrival_counters``). A captured graph padded to
    a fixed block-table width should pass its context bucket as ``max_context_len``; a
    sequence longer than that is still attended to in full (the last split runs to the end
    of its context), only with less parallelism. ``out`` (shaped like ``query``, any row and
    head strides): written and returned instead of a new tensor.
    """
    check_attention_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert seq_lens.shape == (num_seqs,), "one query token per sequence"

    out = check_out(out, query)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if launch is None:
        launch = choose_launch(
            num_seqs, num_kv_heads, max_context_len, query.device, head_dim=head_dim,
            kv_dtype=key_cache.dtype,
        )  # fmt: skip
        if num_splits is not None:
            launch = replace(launch, num_splits=num_splits)
        if one_launch is not None:
            launch = replace(launch, one_launch=one_launch)
    else:
        assert num_splits is None and one_launch is None, "launch= replaces both"
    tile_n = launch.tile_n
    assert launch.num_splits >= 1, launch
    assert tile_n >= 16 and tile_n == next_power_of_2(tile_n), launch
    if launch.pdl and not launch.prefetch_ids:
        raise ValueError(f"{launch}: pdl needs prefetch_ids (what the kernel loads early)")
    # Splits are whole tiles (at least one, even for an empty block table); recount so that
    # no split starts past the context bound.
    tokens_per_split = max(
        tile_n, triton.cdiv(triton.cdiv(max_context_len, launch.num_splits), tile_n) * tile_n
    )
    num_splits = max(1, triton.cdiv(max_context_len, tokens_per_split))

    group = num_heads // num_kv_heads
    head_dim_pad = next_power_of_2(head_dim)
    pdl_launch = pdl_args(launch.pdl, query.device)  # both kernels'
    consts = dict(
        NUM_QUERIES_PER_KV=group,
        GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, head_dim_pad),
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        # A quantized cache's values multiply in the query's dtype (kernels/kv_quant.py).
        **dot_args(_paged_attention_decode_kernel, attention_dtype(query, key_cache)),
        QUANTIZED=kv_quant.is_quantized(key_cache),
        HADAMARD_BLOCK=(
            kv_quant.hadamard_block(head_dim) if kv_quant.is_quantized(key_cache) else 1
        ),
        EARLY_V=launch.early_v,
        PREFETCH_IDS=launch.prefetch_ids,
        **pdl_launch,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    common = (query, key_cache, value_cache, block_tables, seq_lens, scale * _LOG2E)
    table_width = block_tables.shape[1]
    window = NO_WINDOW if sliding_window is None else sliding_window
    assert 1 <= window <= NO_WINDOW, sliding_window
    grid = (num_seqs, num_kv_heads, num_splits)
    if num_splits == 1:
        # lse, final output and counters are unused: any pointer of their type does.
        _paged_attention_decode_kernel[grid](
            out, out, out, seq_lens, *common, tokens_per_split, window, table_width,
            query.stride(0), query.stride(1),
            out.stride(0), out.stride(1), 0,
            0, 0,
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            block_tables.stride(0), 0, 0,
            SPLIT=False, COMBINE=False, SPLITS_PAD=1, **consts,
        )  # fmt: skip
        return out

    # [num_seqs, num_heads, num_splits, head_dim]: fp32 so merging splits loses nothing.
    partial = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
    )
    lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    counters = (
        arrival_counters(query.device, num_seqs * num_kv_heads, "paged_attention_decode")
        if launch.one_launch
        else seq_lens
    )
    _paged_attention_decode_kernel[grid](
        partial, lse, out, counters, *common, tokens_per_split, window, table_width,
        query.stride(0), query.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        SPLIT=True, COMBINE=launch.one_launch,
        SPLITS_PAD=next_power_of_2(num_splits) if launch.one_launch else 1, **consts,
    )  # fmt: skip
    if launch.one_launch:
        return out
    _reduce_splits_kernel[(num_seqs, num_heads)](
        out, partial, lse,
        out.stride(0), out.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        num_splits,
        SPLITS_PAD=next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        **pdl_launch,
    )  # fmt: skip
    return out


def tuned_launches(
    *, head_dim: int | None = None, kv_dtype: torch.dtype | None = None
) -> list[DecodeLaunch]:
    """Every launch ``choose_launch`` can return for a cache of ``head_dim`` and
    ``kv_dtype`` up to its split count, with one split count per compiled variant: unsplit,
    and split with each power-of-two bound on the split count (either merge compiles one
    variant per bound)."""
    launches: dict[DecodeLaunch, None] = {}
    for row in decode_tuning(head_dim=head_dim, kv_dtype=kv_dtype):
        params = (row.num_warps, row.num_stages, row.tile_n, row.early_v, row.prefetch_ids,
                  row.pdl)  # fmt: skip
        launches[DecodeLaunch(1, False, *params)] = None
        if row.target_waves <= 0 or row.max_splits <= 1:
            continue
        # The least count of each power-of-two bound: 2, 3, 5, 9, 17 for 32 splits.
        counts = [2**i // 2 + 1 for i in range(1, row.max_splits.bit_length())]
        for n in counts:
            launches[DecodeLaunch(n, row.one_launch, *params)] = None
    return list(launches)


def compile_variants(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    num_heads: int,
    scale: float,
    query_dtype: torch.dtype,
) -> int:
    """Compile every variant ``paged_attention_decode`` can meet with these caches and
    queries of ``query_dtype`` (the model's dtype; the cache may hold 8-bit rows): each of
    ``tuned_launches()``. Runs one sequence of one token over block 0 (the caches are only
    read). Returns the number of calls made."""
    _, block_size, _, head_dim = key_cache.shape
    device = key_cache.device
    query = torch.zeros((1, num_heads, head_dim), dtype=query_dtype, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    # What choose_launch makes of each row on this device (with_pdl_policy).
    tuned = tuned_launches(head_dim=head_dim, kv_dtype=key_cache.dtype)
    launches = list(dict.fromkeys(with_pdl_policy(t, device) for t in tuned))
    for launch in launches:
        context = launch.num_splits * launch.tile_n
        width = triton.cdiv(context, block_size)
        tables = torch.zeros((1, width), dtype=torch.int32, device=device)
        paged_attention_decode(
            query, key_cache, value_cache, tables, seq_lens, scale,
            max_context_len=context, launch=launch,
        )  # fmt: skip
    return len(launches)
