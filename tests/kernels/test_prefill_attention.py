"""Triton prefill / extend paged attention vs ``kernels.reference.paged_attention_prefill``.

CPU: under TRITON_INTERPRET=1 (set by conftest.py before this import). CUDA: compiled.
Each sequence is given as (seq_len, q_len): its last q_len context tokens are queries, the
first seq_len - q_len are the cached prefix (chunked prefill / prefix caching).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.prefill_attention import paged_attention_prefill
from tests.kernels.sm90_builds import builds_of


def chunks(block_size: int) -> list[tuple[int, int]]:
    """(seq_len, q_len) pairs: ragged context lengths with every kind of chunk."""
    return [
        (1, 1),  # a one-token prompt
        (block_size - 1, block_size - 1),  # whole prompt, no prefix
        (block_size, 3),  # a chunk ending exactly on a block boundary
        (block_size + 1, 1),  # a decode token in a mixed batch
        (block_size + 5, 0),  # scheduled for nothing this step
        (90, 70),  # several query blocks, prefix not block-aligned
    ]


def run_case(paged_kv, close, device, *, chunks, block_size, num_kv_heads, group, head_dim,
             dtype, num_blocks=None, sliding_window=None) -> None:  # fmt: skip
    seq_lens = [seq_len for seq_len, _ in chunks]
    q_lens = torch.tensor([q_len for _, q_len in chunks])
    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int32, device=device)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    kv = paged_kv(
        seq_lens,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        num_blocks=num_blocks,
    )
    num_tokens = int(q_lens.sum())
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    out = paged_attention_prefill(
        query, kv.key_cache, kv.value_cache, kv.block_tables, query_start_loc, kv.seq_lens, scale,
        sliding_window,
    )  # fmt: skip
    expected = reference.paged_attention_prefill(
        query, kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables, query_start_loc,
        kv.seq_lens, scale, sliding_window,
    )  # fmt: skip
    close(out, expected)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_block_sizes_and_gqa_ratios(paged_kv, close, device, block_size, group):
    run_case(paged_kv, close, device, chunks=chunks(block_size), block_size=block_size,
             num_kv_heads=2, group=group, head_dim=64, dtype=torch.float32)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "num_kv_heads"), [(64, 3), (128, 1)])
def test_dtypes_and_head_dims(paged_kv, close, device, dtype, head_dim, num_kv_heads):
    # (64, 3) is SmolLM2-135M: 9 query heads on 3 KV heads (group 3, padded to 4 kernel rows).
    # A shorter long chunk than chunks() keeps the interpreter quick; it still spans 2 tiles.
    cases = chunks(16)[:-1] + [(80, 20)]
    run_case(paged_kv, close, device, chunks=cases, block_size=16,
             num_kv_heads=num_kv_heads, group=3, head_dim=head_dim, dtype=dtype)  # fmt: skip


def test_long_group_fills_whole_program(paged_kv, close, device):
    # Group 16: one query per 16-row program block, so BLOCK_Q = 4 queries per program.
    run_case(paged_kv, close, device, chunks=[(40, 40), (33, 9)], block_size=16,
             num_kv_heads=1, group=16, head_dim=64, dtype=torch.float16)  # fmt: skip


@pytest.mark.parametrize("sliding_window", [1, 7, 70])
@pytest.mark.parametrize("group", [1, 4])
def test_sliding_window(paged_kv, close, device, sliding_window, group):
    # Group 1 puts 64 queries in a program: with a short window its later rows see nothing
    # of the first tiles (their running max stays -inf there, and must not turn into NaN).
    run_case(paged_kv, close, device, chunks=chunks(16), block_size=16, num_kv_heads=2,
             group=group, head_dim=64, dtype=torch.float32,
             sliding_window=sliding_window)  # fmt: skip


def test_huge_pool_block_offsets_need_int64(paged_kv, close, device):
    """Blocks above 2**31 elements into the pool (see test_paged_attention's twin)."""
    block_size, num_kv_heads, head_dim = 16, 1, 64
    num_blocks = (2**31 + 2**20) // (block_size * num_kv_heads * head_dim)
    run_case(paged_kv, close, device, chunks=[(20, 20), (50, 7)], block_size=block_size,
             num_kv_heads=num_kv_heads, group=3, head_dim=head_dim, dtype=torch.float16,
             num_blocks=num_blocks)  # fmt: skip


def test_matches_decode_kernel_semantics(paged_kv, device):
    """q_len == 1 for every sequence is a decode step: both Triton kernels must agree."""
    from kernels.paged_attention import paged_attention_decode

    kv = paged_kv([1, 31, 64], block_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.float32, device=device)  # fmt: skip
    query = torch.randn(3, 6, 64, device=device)
    query_start_loc = torch.arange(4, dtype=torch.int32, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables)
    prefill = paged_attention_prefill(*args, query_start_loc, kv.seq_lens, 0.125)
    decode = paged_attention_decode(*args, kv.seq_lens, 0.125)
    torch.testing.assert_close(prefill, decode, atol=2e-5, rtol=1e-4)


def test_rejects_bad_query_start_loc(device):
    key_cache = torch.zeros(4, 16, 2, 64, device=device)
    block_tables = torch.zeros(2, 1, dtype=torch.int32, device=device)
    seq_lens = torch.ones(2, dtype=torch.int32, device=device)
    query = torch.zeros(2, 4, 64, device=device)
    with pytest.raises(AssertionError):  # needs num_seqs + 1 entries
        paged_attention_prefill(query, key_cache, key_cache, block_tables,
                                torch.arange(2, dtype=torch.int32, device=device),
                                seq_lens, 1.0)  # fmt: skip


@pytest.mark.parametrize("build", builds_of("prefill_attention"))
def test_compiles_for_sm90(sm90_build_errors, build):
    """The compiled (non-interpreted) kernel builds for an H100, even on a CPU-only machine."""
    assert sm90_build_errors[build] is None, sm90_build_errors[build]


def test_out_rows_of_a_larger_buffer(paged_kv, close, device):
    """``out=`` a view of some rows of a wider buffer (the piecewise graphs' attention
    output): the covered rows are written in place, the rows past them left as they were."""
    kv = paged_kv([17, 40], block_size=8, num_kv_heads=2, head_dim=64,
                  dtype=torch.float32, device=device)  # fmt: skip
    query_start_loc = torch.tensor([0, 1, 6], dtype=torch.int32, device=device)
    query = torch.randn(6, 6, 64, device=device)
    buffer = torch.full((8, 6, 64), 7.0, device=device)
    out = paged_attention_prefill(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                  query_start_loc, kv.seq_lens, 0.125, out=buffer[:6])  # fmt: skip
    assert out.data_ptr() == buffer.data_ptr()
    expected = reference.paged_attention_prefill(
        query, kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables, query_start_loc,
        kv.seq_lens, 0.125,
    )  # fmt: skip
    close(buffer[:6], expected)
    assert bool((buffer[6:] == 7.0).all())
    again = reference.paged_attention_prefill(
        query, kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables, query_start_loc,
        kv.seq_lens, 0.125, out=torch.zeros_like(query),
    )  # fmt: skip
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
