"""Triton ``rope_and_store_`` vs ``kernels.reference.rope_and_store_``, and the twin vs the
engine's ``PagedAttention.rope_and_store`` (RoPE, then ``store_kv``).

CPU: under TRITON_INTERPRET=1 (set by conftest.py before this import). CUDA: compiled.
Tolerance: none. The kernel rounds each product and the sum to the dtype as torch's op by
op evaluation does (products of two fp16/bf16 values are exact in float32) and is compiled
without FMA contraction, so Q, the K/V cache and the untouched part of ``qkv`` must match
bit for bit in every dtype.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import PagedAttention
from kernels import reference
from kernels.rope_and_store import rope_and_store_
from tests.kernels.sm90_builds import builds_of

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rope_tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype):
    """cos/sin rows as ``engine.rope.RotaryEmbedding.lookup`` makes them: [num_tokens, 1,
    head_dim], both halves equal, in the model dtype."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float()[:, None].cpu() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1).to(positions.device)
    return emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)


def case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, *, block_size=16,
         num_blocks=6, slot_dtype=torch.int64):  # fmt: skip
    qkv = (2 * torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,))
    cos, sin = rope_tables(positions, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::4] = -1  # padding tokens store nothing
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape).to(dtype)  # old contents must survive
    value_cache = torch.randn(shape).to(dtype)
    return [t.to(device) for t in (qkv, cos, sin, key_cache, value_cache, slots.to(slot_dtype))]


def run_both(num_heads, num_kv_heads, args, block_h=None):
    qkv, cos, sin, key_cache, value_cache, slots = args
    ref = [qkv.clone(), cos, sin, key_cache.clone(), value_cache.clone(), slots]
    q = rope_and_store_(qkv, cos, sin, key_cache, value_cache, slots, num_heads, num_kv_heads,
                        block_h=block_h)  # fmt: skip
    ref_q = reference.rope_and_store_(*ref, num_heads, num_kv_heads)
    assert q.data_ptr() == qkv.data_ptr() and q.shape == ref_q.shape
    assert torch.equal(q, ref_q)
    assert torch.equal(qkv, ref[0])  # Q rotated in place, K and V parts untouched
    assert torch.equal(key_cache, ref[3])
    assert torch.equal(value_cache, ref[4])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (8, 1)])  # GQA 1/4/8
def test_matches_reference(device, dtype, head_dim, num_heads, num_kv_heads):
    args = case(9, num_heads, num_kv_heads, head_dim, dtype, device)
    run_both(num_heads, num_kv_heads, args)


@pytest.mark.parametrize("block_h", [1, 2, 8, 64])
def test_every_tile_of_heads_gives_the_same_bits(device, block_h):
    """``block_h`` heads a program (the benchmark's alternative launches): tiles that end in
    the K heads, straddle Q and K, or hold every row with most masked off."""
    run_both(8, 2, case(5, 8, 2, 64, torch.bfloat16, device), block_h=block_h)


def test_rejects_a_tile_that_is_not_a_power_of_two(device):
    args = case(2, 4, 2, 64, torch.float32, device)
    with pytest.raises(AssertionError):
        rope_and_store_(*args, 4, 2, block_h=3)


def test_smollm2_shape_int32_slots_and_2d_tables(device):
    """9 query heads on 3 KV heads (group 3), int32 slots, cos/sin given as [num_tokens, d]."""
    qkv, cos, sin, key_cache, value_cache, slots = case(
        5, 9, 3, 64, torch.float32, device, block_size=8, slot_dtype=torch.int32
    )
    run_both(9, 3, [qkv, cos[:, 0], sin[:, 0], key_cache, value_cache, slots])


def test_padding_only_writes_no_cache(device):
    qkv, cos, sin, key_cache, value_cache, slots = case(3, 4, 2, 64, torch.float32, device)
    slots.fill_(-1)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    rope_and_store_(qkv, cos, sin, key_cache, value_cache, slots, 4, 2)
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)


def test_huge_pool_block_offsets_need_int64(device):
    """Slots past 2**31 elements of a 4 GiB fp16 pool (only the touched pages are committed)."""
    block_size, num_kv_heads, head_dim = 16, 1, 64
    num_blocks = (2**31 + 2**20) // (block_size * num_kv_heads * head_dim)
    try:
        key_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim,
                                dtype=torch.float16, device=device)  # fmt: skip
        value_cache = torch.empty_like(key_cache)
    except (RuntimeError, MemoryError) as e:  # e.g. vm.overcommit_memory=2
        pytest.skip(f"cannot reserve a {num_blocks}-block pool here: {e}")
    blocks = torch.tensor([num_blocks - 1, 2**21 + 3])
    offsets = torch.tensor([5, block_size - 1])
    slots = (blocks * block_size + offsets).to(device)
    qkv = torch.randn(2, 3 * head_dim, dtype=torch.float16, device=device)
    cos, sin = rope_tables(torch.tensor([3, 900]), head_dim, torch.float16)
    small_k = torch.zeros(2, 1, num_kv_heads, head_dim, dtype=torch.float16, device=device)
    small_v = torch.zeros_like(small_k)
    ref_qkv = qkv.clone()
    rope_and_store_(qkv, cos.to(device), sin.to(device), key_cache, value_cache, slots, 1, 1)
    reference.rope_and_store_(ref_qkv, cos.to(device), sin.to(device), small_k, small_v,
                              torch.tensor([0, 1], device=device), 1, 1)  # fmt: skip
    ids, offs = blocks.to(device), offsets.to(device)
    assert torch.equal(key_cache[ids, offs], small_k[:, 0])
    assert torch.equal(value_cache[ids, offs], small_v[:, 0])


def test_rejects_wrong_qkv_width(device):
    qkv, cos, sin, key_cache, value_cache, slots = case(2, 4, 2, 64, torch.float32, device)
    with pytest.raises(AssertionError):  # claims 6 query heads
        rope_and_store_(qkv, cos, sin, key_cache, value_cache, slots, 6, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_engine_op(dtype):
    """The twin computes what PagedAttention.rope_and_store computes (torch backend), bitwise."""
    qkv, cos, sin, key_cache, value_cache, slots = case(6, 8, 2, 64, dtype, torch.device("cpu"))
    engine_k, engine_v = key_cache.clone(), value_cache.clone()
    engine_q = PagedAttention("torch", scale=1.0).rope_and_store(
        qkv.clone(), (cos, sin), engine_k, engine_v, slots, 8, 2
    )
    ref_q = reference.rope_and_store_(qkv, cos, sin, key_cache, value_cache, slots, 8, 2)
    assert torch.equal(ref_q, engine_q)
    assert torch.equal(key_cache, engine_k) and torch.equal(value_cache, engine_v)


@pytest.mark.parametrize("build", builds_of("rope_and_store"))
def test_compiles_for_sm90(sm90_build_errors, build):
    """The compiled (non-interpreted) kernel builds for an H100, even on a CPU-only machine."""
    assert sm90_build_errors[build] is None, sm90_build_errors[build]
