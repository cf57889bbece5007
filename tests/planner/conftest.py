"""Planner test fixtures: an isolated cache and a fake CPU measurement.

Every test gets its own ``$PAGEDSERVE_CACHE`` and a CPU that "measures" 20 GB/s and
100 GFLOP/s instantly, so no test depends on (or waits for) this machine's speed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import planner.cpu

FAKE_READ_BW = 20e9
FAKE_COPY_BW = 18e9
FAKE_FLOPS = 100e9


@dataclass
class FakeCpu:
    bandwidth_calls: int = 0
    flops_calls: list[str] = field(default_factory=list)

    def bandwidth(self, *args: object, **kwargs: object) -> tuple[float, float]:
        self.bandwidth_calls += 1
        return FAKE_READ_BW, FAKE_COPY_BW

    def flops(self, dtype: str = "fp32", *args: object, **kwargs: object) -> float:
        self.flops_calls.append(dtype)
        return FAKE_FLOPS


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(path))
    return path


@pytest.fixture(autouse=True)
def fake_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCpu]:
    fake = FakeCpu()
    monkeypatch.setattr(planner.cpu, "measure_bandwidth", fake.bandwidth)
    monkeypatch.setattr(planner.cpu, "measure_matmul_flops", fake.flops)
    yield fake
