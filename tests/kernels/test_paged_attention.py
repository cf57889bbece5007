"""Triton decode paged attention vs ``kernels.reference.paged_attention_decode``.

CPU: under TRITON_INTERPRET=1 (set by conftest.py before this import). CUDA: compiled.
Every kernel pool surrounds the context with NaN (see ``conftest.PagedKV``), so each case
also checks that the kernel reads nothing outside ``seq_lens`` and the block tables.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kernels._triton_common as triton_common
import kernels.paged_attention as decode_module
from kernels import kv_quant, reference
from kernels.paged_attention import (
    DECODE_TUNING,
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    TARGET_WAVES,
    DecodeLaunch,
    DecodeTuning,
    choose_launch,
    choose_num_splits,
    paged_attention_decode,
)
from tests.kernels.conftest import assert_counters_zero
from tests.kernels.sm90_builds import builds_of


def ragged_lens(block_size: int) -> list[int]:
    """1, block_size - 1, block_size, block_size + 1 and a long context (several tiles)."""
    return [1, block_size - 1, block_size, block_size + 1, 150]


def run_case(paged_kv, close, device, *, seq_lens, block_size, num_kv_heads, group, head_dim,
             dtype, num_splits=None, num_blocks=None, sliding_window=None,
             one_launch=None) -> None:  # fmt: skip
    kv = paged_kv(
        seq_lens,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        num_blocks=num_blocks,
    )
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    out = paged_attention_decode(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale,
        sliding_window, num_splits=num_splits, one_launch=one_launch,
    )  # fmt: skip
    expected = reference.paged_attention_decode(
        query, kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables, kv.seq_lens, scale,
        sliding_window,
    )  # fmt: skip
    close(out, expected)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_block_sizes_and_gqa_ratios(paged_kv, close, device, block_size, group):
    run_case(paged_kv, close, device, seq_lens=ragged_lens(block_size), block_size=block_size,
             num_kv_heads=2, group=group, head_dim=64, dtype=torch.float32)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "num_kv_heads"), [(64, 3), (128, 1)])
def test_dtypes_and_head_dims(paged_kv, close, device, dtype, head_dim, num_kv_heads):
    # (64, 3) is SmolLM2-135M: 9 query heads on 3 KV heads.
    run_case(paged_kv, close, device, seq_lens=ragged_lens(16), block_size=16,
             num_kv_heads=num_kv_heads, group=3, head_dim=head_dim, dtype=dtype)  # fmt: skip


@pytest.mark.parametrize("head_dim", [32, 80])
def test_other_head_dims(paged_kv, close, device, head_dim):
    # 80 is not a power of two: padded to 128 inside the kernel and masked.
    run_case(paged_kv, close, device, seq_lens=[5, 40], block_size=16,
             num_kv_heads=1, group=4, head_dim=head_dim, dtype=torch.float16)  # fmt: skip


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k(paged_kv, close, device, num_splits, dtype):
    # Short sequences beside a long one: most of their splits are empty (lse = -inf).
    run_case(paged_kv, close, device, seq_lens=[1, 17, 300], block_size=16,
             num_kv_heads=2, group=4, head_dim=64, dtype=dtype,
             num_splits=num_splits)  # fmt: skip


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 70, 1000])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_sliding_window(paged_kv, close, device, sliding_window, num_splits):
    # Windows shorter and longer than a block, a tile and the contexts; with splits, the
    # ones wholly before the window are empty.
    run_case(paged_kv, close, device, seq_lens=ragged_lens(16), block_size=16,
             num_kv_heads=2, group=4, head_dim=64, dtype=torch.float32,
             num_splits=num_splits, sliding_window=sliding_window)  # fmt: skip


def test_huge_pool_block_offsets_need_int64(paged_kv, close, device):
    """Blocks above 2**31 elements into the pool: int32 offsets would wrap.

    The pool is 2**31 + 2**20 fp16 elements per cache (4 GiB each), but only the blocks the
    test uses are written; the rest are never touched, so on CPU the pages stay virtual.
    """
    block_size, num_kv_heads, head_dim = 16, 1, 64
    elems_per_block = block_size * num_kv_heads * head_dim
    num_blocks = (2**31 + 2**20) // elems_per_block
    kv_kwargs = dict(
        seq_lens=[1, 17, 100],
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=4,
        head_dim=head_dim,
        dtype=torch.float16,
        num_blocks=num_blocks,
    )
    run_case(paged_kv, close, device, **kv_kwargs)
    run_case(paged_kv, close, device, num_splits=2, **kv_kwargs)


def test_zero_length_sequence_outputs_zeros(paged_kv, close, device):
    """seq_len 0 (a padding row of a fixed-size, CUDA-graph-style batch) gives zeros, not NaN,
    in both modes, and does not disturb its neighbours."""
    kv = paged_kv([0, 70], block_size=16, num_kv_heads=1, head_dim=64,
                  dtype=torch.float32, device=device)  # fmt: skip
    query = torch.randn(2, 2, 64, device=device)
    expected = reference.paged_attention_decode(
        query[1:], kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables[1:],
        kv.seq_lens[1:], 0.125,
    )  # fmt: skip
    for num_splits in (1, 2):
        out = paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                     kv.seq_lens, 0.125, num_splits=num_splits)  # fmt: skip
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        close(out[1:], expected)


def test_strided_query(paged_kv, close, device):
    """Query as a view into a fused QKV projection: only head_dim needs to be contiguous."""
    kv = paged_kv([9, 33], block_size=8, num_kv_heads=2, head_dim=64,
                  dtype=torch.float32, device=device)  # fmt: skip
    qkv = torch.randn(2, 3 * 8, 64, device=device)  # [num_seqs, q + k + v heads, head_dim]
    query = qkv[:, :8]  # [num_seqs, 8, 64], group 4
    out = paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                 kv.seq_lens, 0.125)  # fmt: skip
    expected = reference.paged_attention_decode(
        query.contiguous(), kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables,
        kv.seq_lens, 0.125,
    )  # fmt: skip
    close(out, expected)


def test_rejects_mismatched_shapes(device):
    key_cache = torch.zeros(4, 16, 2, 64, device=device)
    block_tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(AssertionError):  # 5 query heads on 2 KV heads
        paged_attention_decode(torch.zeros(1, 5, 64, device=device), key_cache, key_cache,
                               block_tables, seq_lens, 1.0)  # fmt: skip
    with pytest.raises(AssertionError):  # int64 block tables
        paged_attention_decode(torch.zeros(1, 4, 64, device=device), key_cache, key_cache,
                               block_tables.long(), seq_lens, 1.0)  # fmt: skip


def heuristic_splits(monkeypatch, num_seqs, num_kv_heads, max_context_len) -> int:
    """What ``choose_num_splits`` picks on a 132-SM GPU (an H100 SXM) for these shapes."""
    monkeypatch.setattr(decode_module, "num_compute_units", lambda device: 132)
    return choose_num_splits(num_seqs, num_kv_heads, max_context_len, torch.device("cuda"))


@pytest.mark.parametrize("group", [1, 4, 8])
def test_short_contexts_with_the_h100_split(paged_kv, close, device, monkeypatch, group):
    """Batch-1-like short contexts split as on an H100 (a split per 64-token tile)."""
    seq_lens = [1, 63, 64, 65, 300]
    num_splits = heuristic_splits(monkeypatch, len(seq_lens), 2, 320)
    # The measured row for up to ~1 wave of contexts <= 512 (DECODE_TUNING): at most 4.
    assert num_splits == 4
    run_case(paged_kv, close, device, seq_lens=seq_lens, block_size=16, num_kv_heads=2,
             group=group, head_dim=64, dtype=torch.float32, num_splits=num_splits)  # fmt: skip


@pytest.mark.parametrize(("group", "dtype"), [(1, torch.float32), (4, torch.bfloat16),
                                              (8, torch.float16)])  # fmt: skip
def test_long_and_ragged_contexts_with_the_h100_split(paged_kv, close, device, monkeypatch,
                                                      group, dtype):  # fmt: skip
    """Contexts of 1 beside one past 4,096, at the split count the heuristic picks for them:
    most splits of the short rows are empty, the long row's are all full."""
    seq_lens = [1, 4100, 17]
    max_context_len = -(-4100 // 16) * 16 + 16  # block-table width (one padding column)
    num_splits = heuristic_splits(monkeypatch, len(seq_lens), 1, max_context_len)
    assert num_splits == MAX_SPLITS  # 3 programs want 176 splits
    run_case(paged_kv, close, device, seq_lens=seq_lens, block_size=16, num_kv_heads=1,
             group=group, head_dim=128, dtype=dtype, num_splits=num_splits)  # fmt: skip


@pytest.mark.parametrize("num_splits", [None, 4])
def test_context_bound_below_a_sequence_still_attends_to_all_of_it(paged_kv, close, device,
                                                                    num_splits):  # fmt: skip
    """A graph captured for a context bucket of 128 serving a 300-token sequence: the last
    split runs to the end of the context, so nothing is dropped."""
    kv = paged_kv([300, 5], block_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.float32, device=device)  # fmt: skip
    query = torch.randn(2, 8, 64, device=device)
    out = paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                 kv.seq_lens, 0.125, num_splits=num_splits,
                                 max_context_len=128)  # fmt: skip
    expected = reference.paged_attention_decode(
        query, kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables, kv.seq_lens, 0.125
    )
    close(out, expected)


# ---- one-launch split-K: the last split of each (sequence, KV head) merges ------------------
# Under the interpreter programs run one after another, so the last split (axis 2 innermost)
# is the one that sees the count reach num_splits - 1; compiled, any split may be last.


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_launch_dtypes_and_head_dims(paged_kv, close, device, dtype, head_dim):
    run_case(paged_kv, close, device, seq_lens=[1, 17, 150], block_size=16, num_kv_heads=2,
             group=4, head_dim=head_dim, dtype=dtype, num_splits=3,
             one_launch=True)  # fmt: skip
    assert_counters_zero(device)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_one_launch_gqa_ratios(paged_kv, close, device, group):
    run_case(paged_kv, close, device, seq_lens=ragged_lens(16), block_size=16, num_kv_heads=2,
             group=group, head_dim=64, dtype=torch.float32, num_splits=4,
             one_launch=True)  # fmt: skip


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_one_launch_empty_splits_and_ragged_split_ends(paged_kv, close, device, num_splits):
    # Bound 320 (a padding column): 2 splits of 192 tokens, 3 of 128, 7 -> 5 of 64; the
    # short rows' later splits are empty (lse = -inf), 300 and 65 end inside a split.
    run_case(paged_kv, close, device, seq_lens=[1, 17, 300, 65], block_size=16,
             num_kv_heads=2, group=4, head_dim=64, dtype=torch.bfloat16,
             num_splits=num_splits, one_launch=True)  # fmt: skip


@pytest.mark.parametrize("sliding_window", [1, 70, 1000])
def test_one_launch_sliding_window(paged_kv, close, device, sliding_window):
    run_case(paged_kv, close, device, seq_lens=ragged_lens(16), block_size=16,
             num_kv_heads=2, group=4, head_dim=64, dtype=torch.float32, num_splits=3,
             sliding_window=sliding_window, one_launch=True)  # fmt: skip


def test_one_launch_zero_length_sequence_outputs_zeros(paged_kv, close, device):
    kv = paged_kv([0, 70, 0], block_size=16, num_kv_heads=1, head_dim=64,
                  dtype=torch.float32, device=device)  # fmt: skip
    query = torch.randn(3, 2, 64, device=device)
    expected = reference.paged_attention_decode(
        query[1:2], kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables[1:2],
        kv.seq_lens[1:2], 0.125,
    )  # fmt: skip
    out = paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                 kv.seq_lens, 0.125, num_splits=2, one_launch=True)  # fmt: skip
    assert torch.equal(out[0::2], torch.zeros_like(out[0::2]))
    close(out[1:2], expected)


def quantized_caches(
    shape: tuple[int, ...],  # (num_blocks, block_size, num_kv_heads, head_dim)
    cache_dtype: torch.dtype,
    device: torch.device,
    key_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A K and a V pool of 8-bit rows (kernels/kv_quant.py) with every slot stored from
    random values (keys times ``key_scale``), quantized by the reference."""
    num_blocks, block_size, num_kv_heads, head_dim = shape
    rows = (num_blocks, block_size, num_kv_heads, head_dim + kv_quant.SCALE_BYTES)
    key_cache, value_cache = (
        kv_quant.quantized_cache(torch.zeros(rows, dtype=torch.uint8, device=device)
                                 .view(cache_dtype))
        for _ in "kv"
    )  # fmt: skip
    num_slots = num_blocks * block_size
    reference.store_kv(
        torch.randn(num_slots, num_kv_heads, head_dim, device=device) * key_scale,
        torch.randn(num_slots, num_kv_heads, head_dim, device=device),
        key_cache, value_cache, torch.arange(num_slots, device=device),
    )  # fmt: skip
    return key_cache, value_cache


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_one_launch_over_a_quantized_cache(device, cache_dtype, query_dtype):
    """The int8 / fp8 KV cache (kernels/kv_quant.py) goes through the same kernel: the
    one-launch merge changes nothing of its de-quantization (tolerances as
    tests/kernels/test_kv_quant.py's: 2e-5 for float32 queries, 2e-2 for bf16)."""
    num_blocks, block_size, num_kv_heads, head_dim = 14, 16, 2, 64
    key_cache, value_cache = quantized_caches(
        (num_blocks, block_size, num_kv_heads, head_dim), cache_dtype, device, key_scale=3
    )
    tables = torch.stack([torch.randperm(num_blocks)[:7] for _ in range(4)]).int().to(device)
    seq_lens = torch.tensor([1, 16, 17, 100], dtype=torch.int32, device=device)
    query = torch.randn(4, 6, head_dim).to(query_dtype).to(device)
    args = (query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5)
    want = reference.paged_attention_decode(*args)
    got = paged_attention_decode(*args, num_splits=3, one_launch=True)
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[query_dtype]
    assert got.dtype == query_dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_one_launch_repeats_bitwise_and_matches_the_two_launch_merge(paged_kv, device):
    """Back-to-back launches (the second finds the counters the first reset) give the same
    bits; a different batch size after them too. Both merges run the same code on the same
    partials (``_merge_head``): bitwise equal under the interpreter; compiled, the kernels'
    reductions may differ in order (float32 rounding apart)."""
    kv = paged_kv([5, 300, 129], block_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.float32, device=device)  # fmt: skip
    query = torch.randn(3, 8, 64, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    first = paged_attention_decode(*args, num_splits=5, one_launch=True)
    assert torch.equal(paged_attention_decode(*args, num_splits=5, one_launch=True), first)
    two_launch = paged_attention_decode(*args, num_splits=5, one_launch=False)
    if device.type == "cpu":
        assert torch.equal(first, two_launch)
    torch.testing.assert_close(first, two_launch, atol=1e-6, rtol=1e-6)
    sub = (query[1:], kv.key_cache, kv.value_cache, kv.block_tables[1:], kv.seq_lens[1:], 0.125)
    assert torch.equal(paged_attention_decode(*sub, num_splits=5, one_launch=True), first[1:])
    assert_counters_zero(query.device)


def test_launch_replaces_the_tuned_launch(paged_kv, close, device):
    """``launch=`` runs exactly the given launch (the sweep's knob): a 32-token tile."""
    kv = paged_kv([40, 100], block_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.float32, device=device)  # fmt: skip
    query = torch.randn(2, 8, 64, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    expected = reference.paged_attention_decode(
        query, kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables, kv.seq_lens, 0.125
    )
    for one_launch in (False, True):
        launch = DecodeLaunch(num_splits=4, one_launch=one_launch, num_warps=2, num_stages=1,
                              tile_n=32)  # fmt: skip
        close(paged_attention_decode(*args, launch=launch), expected)
    with pytest.raises(AssertionError):
        paged_attention_decode(*args, num_splits=2, launch=DecodeLaunch())


@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_early_v_loads_change_no_bit(paged_kv, device, cache_dtype):
    """``early_v`` moves each tile's V load before the scores; the arithmetic is the same,
    so the output is bitwise the default's: unsplit, split with either merge, over a plain
    and a quantized cache."""
    kv = paged_kv([40, 100, 7], block_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.float32, device=device)  # fmt: skip
    key_cache, value_cache = kv.key_cache, kv.value_cache
    if cache_dtype is not None:  # the same block ids over 8-bit rows, every slot written
        key_cache, value_cache = quantized_caches(tuple(key_cache.shape), cache_dtype, device)
    query = torch.randn(3, 8, 64, device=device)
    args = (query, key_cache, value_cache, kv.block_tables, kv.seq_lens, 0.125)
    for splits, one_launch, tile in ((1, False, 64), (4, False, 32), (3, True, 16)):
        launch = DecodeLaunch(splits, one_launch, num_warps=2, num_stages=1, tile_n=tile)
        plain = paged_attention_decode(*args, launch=launch)
        early = paged_attention_decode(*args, launch=replace(launch, early_v=True))
        assert torch.isfinite(plain).all()
        assert torch.equal(early, plain), (splits, one_launch, tile)
    assert_counters_zero(query.device)


@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_prefetched_block_ids_change_no_bit(paged_kv, device, cache_dtype):
    """``prefetch_ids`` loads each split's first tile of block ids beside the sequence's
    length. Without a sliding window the tiles are the same, so the output is bitwise the
    default's: unsplit, split with either merge, tiles that straddle blocks and contexts
    that end inside, at or before a split's first tile (empty splits), over a block table
    wider than the contexts and one exactly as wide as the longest."""
    for width in (None, 7):  # 7 blocks of 16: the 100-token context's own
        kv = paged_kv([40, 100, 7, 1], block_size=16, num_kv_heads=2, head_dim=64,
                      dtype=torch.float32, device=device)  # fmt: skip
        key_cache, value_cache = kv.key_cache, kv.value_cache
        if cache_dtype is not None:  # the same block ids over 8-bit rows, every slot written
            key_cache, value_cache = quantized_caches(tuple(key_cache.shape), cache_dtype, device)
        tables = kv.block_tables if width is None else kv.block_tables[:, :width].contiguous()
        query = torch.randn(4, 8, 64, device=device)
        args = (query, key_cache, value_cache, tables, kv.seq_lens, 0.125)
        for splits, one_launch, tile in ((1, False, 64), (4, False, 32), (3, True, 16),
                                         (7, False, 16)):  # fmt: skip
            launch = DecodeLaunch(splits, one_launch, num_warps=2, num_stages=1, tile_n=tile)
            plain = paged_attention_decode(*args, launch=launch)
            ahead = paged_attention_decode(*args, launch=replace(launch, prefetch_ids=True))
            assert torch.isfinite(plain).all()
            assert torch.equal(ahead, plain), (width, splits, one_launch, tile)
    assert_counters_zero(query.device)


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 33, 70, 1000])
@pytest.mark.parametrize(("num_splits", "tile_n"), [(1, 16), (3, 16), (2, 32)])
def test_prefetched_block_ids_under_a_sliding_window(paged_kv, close, device, sliding_window,
                                                     num_splits, tile_n):  # fmt: skip
    """A window moves a split's start past the tile whose ids were prefetched: that tile is
    masked whole and the walk starts where the plain one does, so the output is still
    bitwise the plain launch's (and the reference's within the tolerance)."""
    kv = paged_kv(ragged_lens(16), block_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.float32, device=device)  # fmt: skip
    query = torch.randn(len(ragged_lens(16)), 8, 64, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125,
            sliding_window)  # fmt: skip
    launch = DecodeLaunch(num_splits, False, num_warps=2, num_stages=1, tile_n=tile_n)
    out = paged_attention_decode(*args, launch=replace(launch, prefetch_ids=True))
    assert torch.equal(out, paged_attention_decode(*args, launch=launch))
    close(out, reference.paged_attention_decode(
        query, kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables, kv.seq_lens, 0.125,
        sliding_window,
    ))  # fmt: skip


def test_pdl_needs_prefetched_ids_and_a_device_that_runs_it(paged_kv, device):
    """A programmatic dependent launch runs only compiled on compute capability >= 9.0;
    asked for elsewhere (or without prefetch_ids) it is an error, and the table's rows
    never ask for it there."""
    kv = paged_kv([5], block_size=16, num_kv_heads=1, head_dim=64, dtype=torch.float32,
                  device=device)  # fmt: skip
    query = torch.randn(1, 2, 64, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    with pytest.raises(ValueError, match="pdl needs prefetch_ids"):
        paged_attention_decode(*args, launch=DecodeLaunch(pdl=True))
    if not decode_module.pdl_supported(device):
        with pytest.raises(ValueError, match="compute capability"):
            paged_attention_decode(*args, launch=DecodeLaunch(prefetch_ids=True, pdl=True))
    assert not decode_module.pdl_supported(torch.device("cpu"))


def test_a_rows_pdl_is_dropped_where_the_device_cannot_run_it(monkeypatch):
    row = replace(DECODE_TUNING[-1], prefetch_ids=True, pdl=True)
    monkeypatch.setattr(decode_module, "DECODE_TUNING", (row,))
    launch = choose_launch(64, 8, 4096, torch.device("cpu"))
    assert launch.prefetch_ids and not launch.pdl
    monkeypatch.setattr(decode_module, "pdl_supported", lambda device: True)
    monkeypatch.setattr(decode_module, "num_compute_units", lambda device: 132)
    assert choose_launch(64, 8, 4096, torch.device("cuda")).pdl


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("one_launch", [False, True])
def test_pdl_launches_match_plain_ones_in_a_cuda_graph(paged_kv, one_launch):
    """Programmatic dependent launches (where the GPU runs them) give the plain launch's
    bits, eagerly and captured in a CUDA graph behind the kernel that writes the query,
    replayed with new context lengths."""
    device = torch.device("cuda")
    if not decode_module.pdl_supported(device):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    kv = paged_kv([700, 1000, 3], block_size=16, num_kv_heads=8, head_dim=128,
                  dtype=torch.bfloat16, device=device)  # fmt: skip
    source = torch.randn(3, 32, 128, device=device).to(torch.bfloat16)
    query = torch.empty_like(source)
    seq_lens = kv.seq_lens.clone()
    plain = DecodeLaunch(8, one_launch, num_warps=4, num_stages=1, tile_n=64, prefetch_ids=True)

    def decode(launch: DecodeLaunch) -> torch.Tensor:
        query.copy_(source * 2)  # the kernel just before writes the query
        return paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                      seq_lens, 128**-0.5, launch=launch)  # fmt: skip

    pdl = replace(plain, pdl=True)
    assert torch.equal(decode(pdl), decode(plain))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(pdl)
    for lens in ([1, 1000, 3], [699, 17, 1]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        source.copy_(torch.randn_like(source, dtype=torch.float32).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, decode(plain)), lens
    if one_launch:
        assert_counters_zero(device)


def test_arrival_counters_grow_without_dropping_older_buffers():
    cpu = torch.device("cpu")
    size = triton_common.arrival_counters(cpu, 1, "test").numel()
    assert size == 1
    older = triton_common._ARRIVAL_COUNTERS[cpu][-1]
    assert older.numel() >= triton_common.MIN_ARRIVAL_COUNTERS
    bigger = triton_common.arrival_counters(cpu, older.numel() + 1, "test")
    assert bigger.numel() == older.numel() + 1 and int(bigger.count_nonzero()) == 0
    assert older is triton_common._ARRIVAL_COUNTERS[cpu][-2]  # a graph may point at it
    triton_common._ARRIVAL_COUNTERS[cpu].pop()  # keep the test's growth to itself


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("one_launch", [False, True])
def test_split_decode_in_a_cuda_graph_replays_twice(paged_kv, close, one_launch):
    """Captured once, replayed twice in a row with new context lengths and queries: the
    one-launch counters must be back at zero after every replay, or the second replay's
    merge would run early (or never) and its output would be stale."""
    device = torch.device("cuda")
    kv = paged_kv([700, 1000, 3], block_size=16, num_kv_heads=8, head_dim=128,
                  dtype=torch.bfloat16, device=device)  # fmt: skip
    query = torch.randn(3, 32, 128, device=device).to(torch.bfloat16)
    seq_lens = kv.seq_lens.clone()

    def decode() -> torch.Tensor:
        return paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                      seq_lens, 128**-0.5, num_splits=8,
                                      one_launch=one_launch)  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode()  # compile and allocate the counters outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode()
    for lens in ([1, 1000, 3], [699, 17, 1]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        query.copy_(torch.randn_like(query, dtype=torch.float32).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        close(out, reference.paged_attention_decode(
            query, kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables, seq_lens,
            128**-0.5,
        ))  # fmt: skip
        if one_launch:
            assert_counters_zero(query.device)


# ---- the launch table ------------------------------------------------------------------------


def test_the_last_tuning_row_covers_every_call():
    last = DECODE_TUNING[-1]
    assert last.waves_below == float("inf")
    assert last.max_context_len >= decode_module.ANY_CONTEXT


def test_the_table_decides_the_launch(monkeypatch):
    """A measured row (short contexts, few programs) before the catch-all: its split policy
    and launch parameters apply to the calls it covers, the catch-all's to the others."""
    monkeypatch.setattr(decode_module, "num_compute_units", lambda device: 132)
    row = DecodeTuning(waves_below=1, max_context_len=1024, target_waves=2,
                       min_tokens_per_split=32, max_splits=16, one_launch=True, num_warps=2,
                       num_stages=1, tile_n=32)  # fmt: skip
    monkeypatch.setattr(decode_module, "DECODE_TUNING", (row, *DECODE_TUNING[-2:]))
    cuda = torch.device("cuda")
    assert choose_launch(1, 8, 512, cuda) == DecodeLaunch(16, True, 2, 1, 32)  # 512 // 32
    assert choose_launch(16, 8, 512, cuda) == DecodeLaunch(3, True, 2, 1, 32)  # 264 / 128
    # 1 x 4,096 is past the row's context: today's split row.
    assert choose_launch(1, 8, 4096, cuda) == DecodeLaunch(MAX_SPLITS, False, 4, 3, 64)
    assert choose_launch(64, 8, 4096, cuda) == DecodeLaunch(1, False, 4, 3, 64)
    # Off CUDA the row's launch parameters still apply, unsplit.
    assert choose_launch(1, 8, 512, torch.device("cpu")) == DecodeLaunch(1, True, 2, 1, 32)


def test_the_h100_rows_give_the_sweeps_best_launches(monkeypatch):
    """The measured rows of DECODE_TUNING reproduce the sweep's best launch of each of the
    issue's short-context rows (32 query / 8 KV heads)."""
    monkeypatch.setattr(decode_module, "num_compute_units", lambda device: 132)
    cuda = torch.device("cuda")
    assert choose_launch(1, 8, 512, cuda) == DecodeLaunch(16, False, 4, 2, 32)
    assert choose_launch(16, 8, 512, cuda) == DecodeLaunch(4, False, 4, 1, 64)
    assert choose_launch(1, 8, 4096, cuda) == DecodeLaunch(32, False, 8, 1, 128)
    assert choose_launch(64, 8, 4096, cuda) == DecodeLaunch(1, False, 4, 3, 64)


class TestChooseNumSplits:
    """The split-K heuristic of the catch-all rows, on a pretend 132-SM GPU (an H100 SXM)."""

    @pytest.fixture(autouse=True)
    def _h100(self, monkeypatch):
        monkeypatch.setattr(decode_module, "num_compute_units", lambda device: 132)
        monkeypatch.setattr(decode_module, "DECODE_TUNING", DECODE_TUNING[-2:])

    def test_full_grid_does_not_split(self):
        assert choose_num_splits(64, 8, 4096, torch.device("cuda")) == 1

    def test_a_single_tile_does_not_split(self):
        assert choose_num_splits(1, 8, 2 * MIN_TOKENS_PER_SPLIT - 1, torch.device("cuda")) == 1

    def test_batch_33_at_8_kv_heads_keeps_the_unsplit_path(self):
        assert choose_num_splits(33, 8, 32768, torch.device("cuda")) == 1
        assert choose_num_splits(256, 8, 4096, torch.device("cuda")) == 1

    def test_llama3_8b_short_contexts(self):
        """The issue's rows: 32 query / 8 KV heads."""
        cuda = torch.device("cuda")
        assert choose_num_splits(1, 8, 512, cuda) == 8  # every 64-token tile its own split
        assert choose_num_splits(16, 8, 512, cuda) == 5  # 128 programs -> 640 >= 4 waves
        assert choose_num_splits(1, 8, 4096, cuda) == MAX_SPLITS == 32

    def test_few_long_sequences_split_to_fill_the_device(self):
        num_splits = choose_num_splits(4, 8, 32768, torch.device("cuda"))
        assert num_splits == 17  # ceil(4 * 132 / 32) programs per (sequence, KV head)
        assert 4 * 8 * num_splits >= TARGET_WAVES * 132

    def test_splits_stay_long_and_bounded(self):
        assert choose_num_splits(1, 1, 4 * MIN_TOKENS_PER_SPLIT, torch.device("cuda")) == 4
        assert choose_num_splits(1, 1, MIN_TOKENS_PER_SPLIT - 1, torch.device("cuda")) == 1
        assert choose_num_splits(1, 1, 10**7, torch.device("cuda")) == MAX_SPLITS

    def test_cpu_never_splits(self, monkeypatch):
        monkeypatch.undo()
        assert choose_num_splits(1, 1, 10**6, torch.device("cpu")) == 1


@pytest.mark.parametrize("build", builds_of("paged_attention"))
def test_compiles_for_sm90(sm90_build_errors, build):
    """The compiled (non-interpreted) kernel builds for an H100, even on a CPU-only machine."""
    assert sm90_build_errors[build] is None, sm90_build_errors[build]


def _compiled_variants() -> int | None:
    """Kernels Triton has compiled for the decode path so far (None: not visible)."""
    total = 0
    for fn in (decode_module._paged_attention_decode_kernel, decode_module._reduce_splits_kernel):
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            return None
        total += sum(len(entry[0]) for entry in caches.values())
    return total


ONE_LAUNCH_TABLE = tuple(
    DecodeTuning(
        waves_below=row.waves_below, max_context_len=row.max_context_len,
        target_waves=row.target_waves, min_tokens_per_split=row.min_tokens_per_split,
        max_splits=row.max_splits, one_launch=True, num_warps=row.num_warps,
        num_stages=row.num_stages, tile_n=row.tile_n,
    )
    for row in DECODE_TUNING
)  # fmt: skip


@pytest.mark.parametrize("table", ["default", "one_launch"])
def test_compile_variants_leaves_nothing_for_traffic_to_compile(paged_kv, device, monkeypatch,
                                                                table):  # fmt: skip
    # What the engine's warm-up runs: afterwards no split count, batch size, context width
    # or split scratch shape a decode step can meet may compile a new kernel (each compile
    # stalls a serving step by hundreds of milliseconds on a GPU).
    if table == "one_launch":
        monkeypatch.setattr(decode_module, "DECODE_TUNING", ONE_LAUNCH_TABLE)
    kv = paged_kv([1], block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                  device=device)  # fmt: skip
    calls = decode_module.compile_variants(kv.key_cache, kv.value_cache, 8, 0.125, torch.float32)
    # Per table row: unsplit, or one split count per power-of-two bound up to its maximum
    # (either merge's variants); the catch-all rows alone make 1 + log2(MAX_SPLITS) of them.
    assert calls == len(decode_module.tuned_launches()) >= 1 + (MAX_SPLITS.bit_length() - 1)
    if device.type != "cuda":
        return  # the interpreter compiles nothing; the calls above checked they run
    before = _compiled_variants()
    if before is None:
        pytest.skip("this Triton does not expose its kernel caches")
    for num_seqs, num_splits in [(1, 1), (3, 2), (5, 4), (2, 7), (7, 13), (4, 21), (1, 32)]:
        lens = [1 + (37 * i) % (num_splits * decode_module.TILE_N) for i in range(num_seqs)]
        run_case(paged_kv, lambda a, b: None, device, seq_lens=lens, block_size=16,
                 num_kv_heads=2, group=4, head_dim=64, dtype=torch.float32,
                 num_splits=num_splits)  # fmt: skip
    assert _compiled_variants() == before


def test_out_rows_of_a_larger_buffer(paged_kv, close, device):
    """``out=`` a view of some rows of a wider buffer (a mixed step writes its decode rows
    into the head of the step's output): written in place, other rows untouched."""
    kv = paged_kv([9, 33, 17], block_size=8, num_kv_heads=2, head_dim=64,
                  dtype=torch.float32, device=device)  # fmt: skip
    query = torch.randn(3, 8, 64, device=device)
    buffer = torch.full((5, 8, 64), 7.0, device=device)
    out = paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                 kv.seq_lens, 0.125, out=buffer[1:4])  # fmt: skip
    assert out.data_ptr() == buffer[1:4].data_ptr()
    expected = reference.paged_attention_decode(
        query, kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables, kv.seq_lens, 0.125
    )
    close(buffer[1:4], expected)
    assert bool((buffer[0] == 7.0).all()) and bool((buffer[4] == 7.0).all())


# ---- PAGEDSERVE_PDL --------------------------------------------------------------------------


def test_the_pdl_switch(monkeypatch):
    """PAGEDSERVE_PDL: unset leaves each launcher's default, 0 turns PDL off, 1 on where
    the device runs it (never on the CPU); anything else is a clear error."""
    from kernels._triton_common import PDL_ENV, pdl_policy

    cpu = torch.device("cpu")
    monkeypatch.delenv(PDL_ENV, raising=False)
    assert pdl_policy(cpu) is None
    monkeypatch.setenv(PDL_ENV, "1")
    assert pdl_policy(cpu) is False
    monkeypatch.setenv(PDL_ENV, "0")
    assert pdl_policy(cpu) is False
    monkeypatch.setenv(PDL_ENV, "yes")
    with pytest.raises(ValueError, match="PAGEDSERVE_PDL must be 0 or 1"):
        pdl_policy(cpu)


def test_the_pdl_switch_turns_decode_launches_on_and_off(monkeypatch):
    from kernels._triton_common import PDL_ENV

    monkeypatch.setattr(decode_module, "pdl_supported", lambda device: True)
    monkeypatch.setattr(decode_module, "pdl_policy", lambda device: None)
    row_pdl = DecodeLaunch(4, prefetch_ids=True, pdl=True)
    cuda = torch.device("cuda")
    assert decode_module.with_pdl_policy(row_pdl, cuda) == row_pdl
    monkeypatch.setattr(decode_module, "pdl_policy", lambda device: True)
    assert decode_module.with_pdl_policy(DecodeLaunch(4), cuda) == row_pdl
    monkeypatch.setattr(decode_module, "pdl_policy", lambda device: False)
    assert decode_module.with_pdl_policy(row_pdl, cuda) == DecodeLaunch(4, prefetch_ids=True)
    # Off a GPU the switch changes nothing, and a layer op asked for PDL there says why.
    monkeypatch.undo()
    monkeypatch.delenv(PDL_ENV, raising=False)
    plain = choose_launch(1, 8, 512, torch.device("cpu"))
    monkeypatch.setenv(PDL_ENV, "1")
    assert choose_launch(1, 8, 512, torch.device("cpu")) == plain
    from kernels.rms_norm import rms_norm

    x = torch.randn(2, 64)
    assert torch.equal(
        rms_norm(x, torch.ones(64), 1e-6), rms_norm(x, torch.ones(64), 1e-6, pdl=False)
    )
    with pytest.raises(ValueError, match="cpu cannot run one"):
        rms_norm(x, torch.ones(64), 1e-6, pdl=True)
