"""The measured ``cpu`` device: cached once, overridable, and the measurement itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner import cpu
from tests.planner.conftest import FAKE_FLOPS, FAKE_READ_BW, FakeCpu

REAL_MEASURE_BANDWIDTH = cpu.measure_bandwidth
REAL_MEASURE_FLOPS = cpu.measure_matmul_flops


def test_cpu_device_is_measured_once_then_cached(cache_dir: Path, fake_cpu: FakeCpu) -> None:
    first = cpu.cpu_device()
    assert first.name == "cpu" and first.measured
    assert first.memory_bandwidth == FAKE_READ_BW  # the better of read and copy
    assert first.peak_flops == {"fp32": FAKE_FLOPS}
    assert (fake_cpu.bandwidth_calls, fake_cpu.flops_calls) == (1, ["fp32"])
    cached = json.loads((cache_dir / cpu.CACHE_FILE).read_text())
    (entry,) = cached.values()
    assert entry["read_bandwidth"] == FAKE_READ_BW and "measured_at" in entry

    again = cpu.cpu_device()
    assert again.memory_bandwidth == first.memory_bandwidth
    assert (fake_cpu.bandwidth_calls, fake_cpu.flops_calls) == (1, ["fp32"])  # from the cache

    cpu.cpu_device(("bf16",))  # a new dtype measures only its matmul
    assert (fake_cpu.bandwidth_calls, fake_cpu.flops_calls) == (1, ["fp32", "bf16"])
    cpu.cpu_device(refresh=True)
    assert fake_cpu.bandwidth_calls == 2


def test_cache_is_per_machine_fingerprint(
    cache_dir: Path, fake_cpu: FakeCpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu.cpu_device()
    monkeypatch.setattr(cpu, "cpu_fingerprint", lambda: "another machine")
    cpu.cpu_device()
    assert fake_cpu.bandwidth_calls == 2
    assert len(json.loads((cache_dir / cpu.CACHE_FILE).read_text())) == 2


def test_a_read_bandwidth_from_older_probes_is_measured_again(
    cache_dir: Path, fake_cpu: FakeCpu
) -> None:
    """A figure cached before the packed-row probe existed may sit below what the engine
    reads (an MBU above 1): it is measured again, the cached FLOP/s kept."""
    cpu.cpu_device()
    path = cache_dir / cpu.CACHE_FILE
    cache = json.loads(path.read_text())
    (entry,) = cache.values()
    del entry["read_probes_version"]
    entry["read_bandwidth"] = 1.0
    path.write_text(json.dumps(cache))
    assert cpu.cpu_device().memory_bandwidth == FAKE_READ_BW
    assert (fake_cpu.bandwidth_calls, fake_cpu.flops_calls) == (2, ["fp32"])


def test_a_corrupt_cache_is_measured_over(cache_dir: Path, fake_cpu: FakeCpu) -> None:
    cache_dir.mkdir(parents=True)
    (cache_dir / cpu.CACHE_FILE).write_text("{not json")
    assert cpu.cpu_device().memory_bandwidth == FAKE_READ_BW
    assert fake_cpu.bandwidth_calls == 1


def test_real_measurements_are_positive_and_plausible() -> None:
    # The real functions, captured at import before the fixture patched the module, on
    # small sizes and without a time budget so the test stays fast.
    read, copy = REAL_MEASURE_BANDWIDTH(num_bytes=8 << 20, repeats=2, budget_s=0.0)
    assert 1e8 < read < 1e13 and 1e8 < copy < 1e13
    flops = REAL_MEASURE_FLOPS("fp32", n=128, repeats=2, budget_s=0.0)
    assert 1e8 < flops < 1e14
