"""kvpool.host_memory: zero-filled CPU tensors on huge pages, and the KV cache that uses them."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from kvpool import host_memory
from kvpool.storage import KVCacheStorage, KVCapacity

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The selected THP mode ("always", "madvise", "never"), or None without THP."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def test_large_tensor_is_zero_contiguous_and_aligned() -> None:
    t = host_memory.zeros((3, 1 << 20), torch.float32)  # 12 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    if host_memory.enabled():
        assert t.data_ptr() % host_memory.HUGE_PAGE_BYTES == 0


def test_views_keep_the_mapping_alive() -> None:
    t = host_memory.zeros((1 << 20,), torch.float32)
    t.fill_(3.0)
    tail = t[-8:]
    del t
    gc.collect()
    assert tail.tolist() == [3.0] * 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_small_tensors_and_other_dtypes(dtype: torch.dtype) -> None:
    small = host_memory.zeros((4, 5), dtype)
    assert small.shape == (4, 5) and small.dtype == dtype and not small.any()
    large = host_memory.zeros((2, 1 << 20), dtype)
    assert large.dtype == dtype and not large.any()


def test_switch_off_gives_ordinary_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_memory.ENV_SWITCH, "0")
    assert not host_memory.enabled()
    t = host_memory.zeros((1 << 20,), torch.float32)
    assert not t.any() and t.is_contiguous()


@pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or _thp_mode() not in ("always", "madvise"),
    reason="the OS gives no transparent huge pages on request here",
)
def test_pages_are_huge_where_the_os_allows() -> None:
    t = host_memory.zeros(((64 << 20) // 4,), torch.float32)  # 64 MiB, already faulted in
    # The kernel may decline when memory is fragmented; it must not decline everything.
    assert host_memory.huge_page_bytes(t) >= host_memory.HUGE_PAGE_BYTES


def test_kv_cache_storage_is_zero_and_writable() -> None:
    capacity = KVCapacity(num_blocks=64, block_size=16, bytes_per_token=2 * 2 * 4 * 64 * 4)
    storage = KVCacheStorage(
        capacity,
        num_layers=2,
        num_kv_heads=4,
        head_dim=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for cache in storage.key_caches + storage.value_caches:
        assert cache.shape == (64, 16, 4, 64) and cache.is_contiguous() and not cache.any()
    storage.key_caches[1][5].fill_(1.0)
    storage.copy_blocks([5], [9])
    assert bool((storage.key_caches[1][9] == 1.0).all())
    assert not storage.key_caches[0].any()


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_quantized_copy_blocks_copies_values_and_scales(cache_dtype: str) -> None:
    """Copy-on-write of a quantized pool's block (a fully cached prompt's last block) moves
    its rows' bytes, scales included; on CPU torch has no float8 index_copy_."""
    capacity = KVCapacity(num_blocks=16, block_size=4, bytes_per_token=0, cache_dtype=cache_dtype)
    storage = KVCacheStorage(
        capacity,
        num_layers=1,
        num_kv_heads=2,
        head_dim=32,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    raw = storage.raw_caches[1].view(torch.uint8)  # the layer's V: [16, 4, 2, 32 + 2]
    raw[5] = torch.randint(0, 255, raw[5].shape, dtype=torch.uint8)
    storage.copy_blocks([5], [9])
    assert torch.equal(raw[9], raw[5])
    assert not storage.raw_caches[0].view(torch.uint8).any()
