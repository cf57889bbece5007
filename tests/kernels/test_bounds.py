"""The kernels never address memory outside the tensors they are given.

On a GPU such an access is an illegal memory access: reported asynchronously, at a later
synchronising call, and sticky (every CUDA call after it in the process fails), or, just past
a tensor, a silent read or write of a neighbour. Under the interpreter every kernel test of
this folder runs with ``tests/kernels/bounds.py``'s address check (conftest.py); the first
tests here show that the check catches what it must, the others feed the launchers the
inputs whose addresses are computed but must never be dereferenced: block-table padding
holding ids far outside the pool (or -1), and slot -1 at the very start of the cache.
On CUDA the same cases run compiled, and tests/conftest.py synchronises after each, so a
fault is reported here.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.paged_attention import paged_attention_decode
from kernels.prefill_attention import paged_attention_prefill
from kernels.rope_and_store import rope_and_store_
from kernels.store_kv import store_kv
from tests.kernels.conftest import INTERPRET

# Block ids a padded table may hold: far past the pool, and negative.
PADDING_IDS = [2**30, -1]


@triton.jit
def _shift_copy(x_ptr, out_ptr, n, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs + SHIFT, mask=mask), mask=mask)


@triton.jit
def _count(counter_ptr, SHIFT: tl.constexpr):
    tl.atomic_add(counter_ptr + SHIFT, 1)


interpreter_only = pytest.mark.skipif(not INTERPRET, reason="checks the interpreter's loads")


@interpreter_only
def test_a_load_past_the_end_fails_where_it_happens():
    from tests.kernels.bounds import OutOfBoundsAccess

    x, out = torch.arange(16, dtype=torch.float32), torch.zeros(16)
    _shift_copy[(1,)](x, out, 15, SHIFT=1, BLOCK=16)  # the last lane is masked off
    assert torch.equal(out[:15], x[1:])
    with pytest.raises(Exception, match="_shift_copy: load of 1 element") as caught:
        _shift_copy[(1,)](x, out, 16, SHIFT=1, BLOCK=16)
    assert isinstance(caught.value.__cause__, OutOfBoundsAccess)
    assert "64 bytes into x_ptr, which holds 64 bytes" in str(caught.value)


@interpreter_only
def test_a_load_before_the_start_and_a_stray_atomic_fail():
    with pytest.raises(Exception, match="4 bytes before"):
        _shift_copy[(1,)](torch.arange(16.0), torch.zeros(16), 4, SHIFT=-1, BLOCK=16)
    counter = torch.zeros(2, dtype=torch.int32)
    _count[(3,)](counter, SHIFT=1)
    assert counter.tolist() == [0, 3]
    with pytest.raises(Exception, match="_count: atomic"):
        _count[(1,)](counter, SHIFT=2)


@interpreter_only
def test_a_store_past_the_end_fails_before_it_writes():
    x, out = torch.arange(32.0), torch.zeros(16)
    with pytest.raises(Exception, match="store of 8 element"):
        _shift_copy[(1,)](x, out[8:].clone(), 16, SHIFT=0, BLOCK=16)  # out_ptr holds 8


def pad_tables(tables: torch.Tensor, seq_lens: list[int], block_size: int, pad: int):
    """Each row's entries past its context's last block set to ``pad``."""
    padded = tables.clone()
    for row, n in enumerate(seq_lens):
        padded[row, -(-n // block_size) :] = pad
    return padded


@pytest.mark.parametrize("pad", PADDING_IDS)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("one_launch", [False, True])
def test_decode_never_reads_block_table_padding(paged_kv, close, device, pad, num_splits,
                                                one_launch):  # fmt: skip
    seq_lens = [1, 16, 17, 40, 0]  # a zero-length row: a CUDA-graph batch's padding
    kv = paged_kv(seq_lens, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                  device=device)  # fmt: skip
    width = kv.block_tables.shape[1]
    tables = torch.full((len(seq_lens), width + 2), pad, dtype=torch.int32, device=device)
    tables[:, :width] = pad_tables(kv.block_tables, seq_lens, 16, pad)
    query = torch.randn(len(seq_lens), 8, 64, device=device)
    out = paged_attention_decode(query, kv.key_cache, kv.value_cache, tables, kv.seq_lens,
                                 0.125, num_splits=num_splits, one_launch=one_launch)  # fmt: skip
    live = slice(0, 4)
    expected = reference.paged_attention_decode(
        query[live], kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables[live],
        kv.seq_lens[live], 0.125,
    )  # fmt: skip
    close(out[live], expected)
    assert torch.equal(out[4], torch.zeros_like(out[4]))


@pytest.mark.parametrize("pad", PADDING_IDS)
def test_prefill_never_reads_block_table_padding(paged_kv, close, device, pad):
    chunks = [(5, 5), (17, 3), (40, 16), (9, 0)]  # (seq_len, q_len); the last one idle
    seq_lens = [s for s, _ in chunks]
    kv = paged_kv(seq_lens, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                  device=device)  # fmt: skip
    tables = pad_tables(kv.block_tables, seq_lens, 16, pad)
    q_lens = torch.tensor([q for _, q in chunks])
    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    query_start_loc = query_start_loc.to(device)
    query = torch.randn(int(q_lens.sum()), 8, 64, device=device)
    out = paged_attention_prefill(query, kv.key_cache, kv.value_cache, tables, query_start_loc,
                                  kv.seq_lens, 0.125)  # fmt: skip
    expected = reference.paged_attention_prefill(
        query, kv.ref_key_cache, kv.ref_value_cache, kv.ref_block_tables, query_start_loc,
        kv.seq_lens, 0.125,
    )  # fmt: skip
    close(out, expected)


def test_slot_minus_one_stores_nothing_at_the_cache_start(device):
    """Slot -1 addresses the row just before the cache: store_kv and rope_and_store_ must
    not write it (nor anything else) for a padding token."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    key_cache = torch.randn(2, block_size, num_kv_heads, head_dim, device=device)
    value_cache = torch.randn_like(key_cache)
    before = key_cache.clone(), value_cache.clone()
    slots = torch.tensor([-1, -1, -1], device=device)
    key = torch.randn(3, num_kv_heads, head_dim, device=device)
    store_kv(key, key, key_cache, value_cache, slots)
    qkv = torch.randn(3, (num_heads + 2 * num_kv_heads) * head_dim, device=device)
    cos, sin = torch.ones(3, head_dim, device=device), torch.zeros(3, head_dim, device=device)
    rope_and_store_(qkv, cos, sin, key_cache, value_cache, slots, num_heads, num_kv_heads)
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])
