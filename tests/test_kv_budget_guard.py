"""The suite's KV-budget guard (``_explicit_kv_budget`` in tests/conftest.py): on a machine
with CUDA, a test whose engine would size its KV cache from the GPU's free memory fails,
naming the flags that fix it, so that ``pytest -n 4`` on one GPU never has one worker take
90% of it."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import builder
from engine.config import EngineConfig
from kvpool.config import KVPoolConfig
from scheduler.config import SchedulerConfig
from tests import conftest
from tests.test_isolation import run_child_pytest


def size_on_cuda(kv_config: KVPoolConfig) -> int:
    """``builder.size_kv_pool`` for a CUDA engine of two layers, up to the budget branch: no
    GPU is touched when the guard refuses, or when ``kv_config`` brings a block count."""
    model = SimpleNamespace(config=SimpleNamespace(num_layers=2, head_dim=16))
    capacity, _ = builder.size_kv_pool(
        EngineConfig(model="tiny-llama"), kv_config, SchedulerConfig(), model,  # type: ignore[arg-type]
        None, builder.GraphPlan([], []), 2, torch.device("cuda"), torch.bfloat16, None, 512,
    )  # fmt: skip
    return capacity.num_blocks


def test_the_default_gpu_budget_fails_the_test_and_an_explicit_one_passes(monkeypatch):
    monkeypatch.setattr(builder, "gpu_kv_budget", conftest.refuse_the_default_gpu_kv_budget)
    with pytest.raises(pytest.fail.Exception, match="without an explicit KV budget") as failed:
        size_on_cuda(KVPoolConfig())
    assert "num_kv_blocks=" in str(failed.value) and "kv_cache_memory=" in str(failed.value)
    assert size_on_cuda(KVPoolConfig(num_blocks=8)) == 8


SCRIPTED_CONFTEST = """
import torch

from tests.conftest import _explicit_kv_budget  # noqa: F401

torch.cuda.is_available = lambda: True  # what the guard asks; nothing else here uses CUDA
"""

SCRIPTED_TESTS = """
from engine import builder
from tests.conftest import refuse_the_default_gpu_kv_budget
from tests.test_kv_budget_guard import size_on_cuda
from kvpool.config import KVPoolConfig

def test_guarded():
    assert builder.gpu_kv_budget is refuse_the_default_gpu_kv_budget

def test_default_budget():
    size_on_cuda(KVPoolConfig())

def test_explicit_budget():
    assert size_on_cuda(KVPoolConfig(num_blocks=8)) == 8
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run below scripts a CPU-only torch")
def test_the_autouse_guard_engages_where_cuda_is_present(tmp_path: Path):
    """A real pytest run with the guard and a torch that reports CUDA: the engine sized from
    the default budget fails its test by name, the others pass."""
    out = run_child_pytest(tmp_path, SCRIPTED_CONFTEST, textwrap.dedent(SCRIPTED_TESTS))
    assert "FAILED test_scripted.py::test_default_budget" in out, out
    assert "without an explicit KV budget" in out, out
    assert "PASSED test_scripted.py::test_guarded" in out, out
    assert "PASSED test_scripted.py::test_explicit_budget" in out, out
    assert "1 failed, 2 passed" in out, out


def test_the_guard_is_installed_exactly_where_cuda_is():
    """On a machine with CUDA every test runs guarded; without it the builder keeps the real
    function (nothing to guard: no engine reaches that branch)."""
    from engine.gpu_memory import gpu_kv_budget

    expected = (
        conftest.refuse_the_default_gpu_kv_budget if torch.cuda.is_available() else gpu_kv_budget
    )
    assert builder.gpu_kv_budget is expected
