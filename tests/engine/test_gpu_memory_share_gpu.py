"""--gpu-memory-utilization on a real GPU: the KV cache an engine sizes from a share of the
GPU stays within that share, and the engine serves."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams, builder
from engine.gpu_memory import gpu_kv_budget

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

SHARE = 0.05  # small: the GPU tests run four workers on one GPU


def test_a_share_of_the_gpu_bounds_the_kv_cache(monkeypatch, tiny_llama_gqa) -> None:
    # The suite refuses budgets taken from the GPU's free memory (tests/conftest.py); this
    # test measures one, a small share.
    monkeypatch.setattr(builder, "gpu_kv_budget", gpu_kv_budget)
    # The engine reads the device-wide free memory before and after loading and charges the
    # difference to itself (vLLM's profiling does the same: what other processes allocate or
    # free meanwhile counts). Under `pytest -n 4` the other workers load and free engines in
    # that window, by gigabytes, so here the GPU is seen as this process's allocator sees it:
    # free at the start, less what it has reserved since.
    free0, total = torch.cuda.mem_get_info()
    reserved0 = torch.cuda.memory_reserved()

    def own_mem_get_info(device=None) -> tuple[int, int]:
        return free0 - (torch.cuda.memory_reserved() - reserved0), total

    monkeypatch.setattr(torch.cuda, "mem_get_info", own_mem_get_info)
    llm = LLM(str(tiny_llama_gqa), device="cuda", gpu_memory_utilization=SHARE, max_num_seqs=4)
    capacity = llm.engine.kv_capacity
    kv_bytes = capacity.num_blocks * capacity.block_size * capacity.bytes_per_token
    assert 0 < kv_bytes <= SHARE * total, (kv_bytes, total)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (out,) = llm.generate([[5, 6, 7]], params)
    assert len(out.token_ids) == 4
