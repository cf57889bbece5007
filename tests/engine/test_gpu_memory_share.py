"""--gpu-memory-utilization: the KV cache gets the share of the GPU's total memory less what
the engine holds (weights since the baseline, the steps' reserve), within what is free; a
share more than is free before loading is refused in one line. The GPU itself is stood in
for (torch.cuda.mem_get_info), so the arithmetic and the refusals run on the CPU."""

from __future__ import annotations

import pytest
import torch

from engine import builder
from engine.config import KVCacheSettingError
from engine.gpu_memory import KV_FRACTION, kv_budget_bytes, memory_baseline
from kvpool.config import KVPoolConfig

GIB = 2**30


def test_without_a_share_the_kv_cache_takes_its_fraction_of_what_is_free() -> None:
    assert kv_budget_bytes(60 * GIB, 80 * GIB, 10 * GIB) == int(50 * GIB * KV_FRACTION)


def test_a_share_of_the_total_less_what_the_engine_holds() -> None:
    # 80 GiB GPU, 70 free before loading, 16 GiB of weights (54 free after), 4 GiB reserve.
    half = kv_budget_bytes(54 * GIB, 80 * GIB, 4 * GIB, utilization=0.5, baseline_free=70 * GIB)
    assert half == 40 * GIB - 16 * GIB - 4 * GIB
    # A share only lowers the budget: above the default it is the default's.
    most = kv_budget_bytes(54 * GIB, 80 * GIB, 4 * GIB, utilization=1.0, baseline_free=70 * GIB)
    assert most == int(50 * GIB * KV_FRACTION)
    # Too small a share for the weights and the reserve: nothing (gpu_kv_budget refuses it).
    assert kv_budget_bytes(54 * GIB, 80 * GIB, 4 * GIB, utilization=0.2, baseline_free=70 * GIB) < 0
    with pytest.raises(ValueError, match="needs the free memory before loading"):
        kv_budget_bytes(54 * GIB, 80 * GIB, 4 * GIB, utilization=0.5)


def test_a_share_more_than_is_free_is_refused_before_loading(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * GIB, 80 * GIB))
    assert memory_baseline(torch.device("cuda"), 0.3) == 30 * GIB
    with pytest.raises(KVCacheSettingError) as refused:
        memory_baseline(torch.device("cuda"), 0.45)
    message = str(refused.value)
    assert "--gpu-memory-utilization 0.45 asks for 36.00 GiB of cuda's 80.00 GiB" in message
    assert "only 30.00 GiB is free" in message and "\n" not in message


def test_the_builder_takes_the_baseline_only_where_the_share_decides(monkeypatch, caplog):
    taken = []
    monkeypatch.setattr(builder, "memory_baseline", lambda d, share: taken.append(d) or 7)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    half = KVPoolConfig(gpu_memory_utilization=0.5)
    assert builder.gpu_memory_baseline(half, cuda, None) == 7
    assert taken == [cuda]
    overridden = [
        KVPoolConfig(gpu_memory_utilization=0.5, memory_bytes=GIB),
        KVPoolConfig(gpu_memory_utilization=0.5, num_blocks=8),
        KVPoolConfig(),
    ]
    for kv in overridden:
        assert builder.gpu_memory_baseline(kv, cuda, None) is None
    with caplog.at_level("WARNING", logger="engine.builder"):
        assert builder.gpu_memory_baseline(half, cpu, None) is None
    assert "--gpu-memory-utilization applies on CUDA" in caplog.text
    assert taken == [cuda]


def test_the_offline_engine_passes_the_share_to_its_kv_pool(monkeypatch) -> None:
    import engine.llm as offline

    seen: list[KVPoolConfig] = []
    monkeypatch.setattr(offline, "LLMEngine", lambda config, kv, scheduler: seen.append(kv))
    offline.LLM("tiny-llama", load_format="dummy", gpu_memory_utilization=0.5)
    assert [kv.gpu_memory_utilization for kv in seen] == [0.5]
