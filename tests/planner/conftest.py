"""Planner test fixtures: an isolated cache and a fake CPU measurement.

Every test gets its own ``$PAGEDSERVE_CACHE`` and a CPU that "measures" 20 GB/s and
100 GFLOP/s instantly on a quiet machine, so no test depends on (or waits for) this machine's
speed or load.
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
    """Probes that return set figures at once, on a fake clock: each probe takes one second,
    during which the rest of the (2-CPU) machine uses ``others_fraction`` of it."""

    read_bw: float = FAKE_READ_BW
    copy_bw: float = FAKE_COPY_BW
    matmul_flops: float = FAKE_FLOPS
    others_fraction: float = 0.0
    bandwidth_calls: int = 0
    flops_calls: list[str] = field(default_factory=list)
    probes: list[str] = field(default_factory=list)  # "full" or "quick", in call order
    wall_s: float = 0.0
    busy_s: float = 0.0

    def _run(self, kwargs: dict[str, object]) -> None:
        self.probes.append("quick" if kwargs.get("budget_s") == 0.0 else "full")
        self.wall_s += 1.0
        self.busy_s += self.others_fraction * 2

    def bandwidth(self, *args: object, **kwargs: object) -> tuple[float, float]:
        self.bandwidth_calls += 1
        self._run(kwargs)
        return self.read_bw, self.copy_bw

    def flops(self, dtype: str = "fp32", *args: object, **kwargs: object) -> float:
        self.flops_calls.append(dtype)
        self._run(kwargs)
        return self.matmul_flops

    def cpu_times(self) -> planner.cpu.CpuTimes:
        return planner.cpu.CpuTimes(self.wall_s, self.busy_s, 0.0, 2)


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
    monkeypatch.setattr(planner.cpu, "read_cpu_times", fake.cpu_times)
    yield fake
