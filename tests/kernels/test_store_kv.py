"""Triton ``store_kv`` vs ``kernels.reference.store_kv`` (index assignment).

CPU: under TRITON_INTERPRET=1 (set by conftest.py before this import). CUDA: compiled.
Writes are compared bit for bit: a store is a copy (plus the same cast as the reference).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.store_kv import store_kv
from tests.kernels.sm90_builds import builds_of


def random_slots(num_tokens: int, num_blocks: int, block_size: int, device) -> torch.Tensor:
    """Distinct slots at shuffled, non-contiguous blocks, with every 5th token padding."""
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::5] = -1
    return slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), [(8, 1, 64), (16, 3, 64),
                                                                       (32, 2, 128)])  # fmt: skip
def test_matches_reference(device, dtype, block_size, num_kv_heads, head_dim):
    num_tokens, num_blocks = 23, 12
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = random_slots(num_tokens, num_blocks, block_size, device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)  # old contents must survive
    value_cache = torch.randn_like(key_cache)
    ref_key_cache, ref_value_cache = key_cache.clone(), value_cache.clone()

    store_kv(key, value, key_cache, value_cache, slots)
    reference.store_kv(key, value, ref_key_cache, ref_value_cache, slots)
    assert torch.equal(key_cache, ref_key_cache)
    assert torch.equal(value_cache, ref_value_cache)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_casts_to_the_cache_dtype(device, cache_dtype):
    """fp32 K/V into a half-precision cache, rounded like torch's ``.to()`` (nearest even).

    Exception: Triton 3.x's interpreter truncates fp32 -> bf16 (compiled code rounds), so on
    CPU bf16 may differ from torch by one bf16 ulp, and only towards zero.
    """
    key = torch.randn(6, 2, 64, device=device)
    value = torch.randn_like(key)
    slots = torch.tensor([3, -1, 0, 17, 30, 9], device=device)
    key_cache = torch.zeros(4, 8, 2, 64, dtype=cache_dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    ref_key_cache, ref_value_cache = key_cache.clone(), value_cache.clone()

    store_kv(key, value, key_cache, value_cache, slots)
    reference.store_kv(key, value, ref_key_cache, ref_value_cache, slots)
    if cache_dtype == torch.bfloat16 and device.type == "cpu":
        for got, want in ((key_cache, ref_key_cache), (value_cache, ref_value_cache)):
            ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()
            assert ((got.float() - want.float()).abs() <= ulp).all()
            assert (got.float().abs() <= want.float().abs()).all()  # truncation, towards zero
    else:
        assert torch.equal(key_cache, ref_key_cache)
        assert torch.equal(value_cache, ref_value_cache)


def test_padding_only_writes_nothing(device):
    key = torch.randn(4, 2, 64, device=device)
    key_cache = torch.zeros(2, 8, 2, 64, device=device)
    value_cache = torch.zeros_like(key_cache)
    store_kv(key, key, key_cache, value_cache, torch.full((4,), -1, device=device))
    assert not key_cache.any() and not value_cache.any()


def test_strided_inputs_and_int32_slots(device):
    """K and V as views into a fused QKV projection; int32 slot mapping."""
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 6, 2, 64
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=device)
    key = qkv[:, num_heads : num_heads + num_kv_heads]  # [num_tokens, num_kv_heads, head_dim]
    value = qkv[:, num_heads + num_kv_heads :]
    slots = random_slots(num_tokens, 5, 16, device).to(torch.int32)
    key_cache = torch.zeros(5, 16, num_kv_heads, head_dim, device=device)
    value_cache = torch.zeros_like(key_cache)
    ref_key_cache, ref_value_cache = key_cache.clone(), value_cache.clone()

    store_kv(key, value, key_cache, value_cache, slots)
    reference.store_kv(key, value, ref_key_cache, ref_value_cache, slots)
    assert torch.equal(key_cache, ref_key_cache)
    assert torch.equal(value_cache, ref_value_cache)


def test_huge_pool_block_offsets_need_int64(device):
    """Slots past 2**31 elements into a 4 GiB fp16 pool: int32 offsets would wrap.

    Only the blocks written are ever touched, so on CPU the pool's pages stay virtual; the
    check reads back just those blocks.
    """
    block_size, num_kv_heads, head_dim = 16, 1, 64
    num_blocks = (2**31 + 2**20) // (block_size * num_kv_heads * head_dim)
    try:
        key_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim,
                                dtype=torch.float16, device=device)  # fmt: skip
        value_cache = torch.empty_like(key_cache)
    except (RuntimeError, MemoryError) as e:  # e.g. vm.overcommit_memory=2
        pytest.skip(f"cannot reserve a {num_blocks}-block pool here: {e}")
    top_blocks = torch.tensor([num_blocks - 1, num_blocks - 7, 2**21 + 3])
    assert int(top_blocks.min()) * block_size * num_kv_heads * head_dim >= 2**31
    offsets = torch.tensor([0, 5, block_size - 1])
    slots = (top_blocks * block_size + offsets).to(device)
    key = torch.randn(3, num_kv_heads, head_dim, dtype=torch.float16, device=device)
    value = torch.randn_like(key)

    store_kv(key, value, key_cache, value_cache, slots)
    ids = top_blocks.to(device)
    assert torch.equal(key_cache[ids, offsets.to(device)], key)
    assert torch.equal(value_cache[ids, offsets.to(device)], value)


def test_rejects_wrong_head_count(device):
    key = torch.randn(3, 4, 64, device=device)
    key_cache = torch.zeros(2, 8, 2, 64, device=device)
    with pytest.raises(AssertionError):
        store_kv(key, key, key_cache, key_cache.clone(), torch.zeros(3, dtype=torch.long,
                                                                      device=device))  # fmt: skip


@pytest.mark.parametrize("build", builds_of("store_kv"))
def test_compiles_for_sm90(sm90_build_errors, build):
    """The compiled (non-interpreted) kernel builds for an H100, even on a CPU-only machine."""
    assert sm90_build_errors[build] is None, sm90_build_errors[build]
