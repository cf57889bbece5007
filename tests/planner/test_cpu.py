"""The measured ``cpu`` device: cached once, overridable, and the measurement itself."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from planner import cpu
from tests.planner.conftest import FAKE_FLOPS, FAKE_READ_BW, FakeCpu

REAL_MEASURE_BANDWIDTH = cpu.measure_bandwidth
REAL_MEASURE_FLOPS = cpu.measure_matmul_flops
REAL_READ_CPU_TIMES = cpu.read_cpu_times


def _entry(cache_dir: Path) -> dict:
    (entry,) = json.loads((cache_dir / cpu.CACHE_FILE).read_text()).values()
    return entry


def test_cpu_device_is_measured_in_full_once_then_re_probed_quickly(
    cache_dir: Path, fake_cpu: FakeCpu
) -> None:
    first = cpu.cpu_device()
    assert first.name == "cpu" and first.measured
    assert first.memory_bandwidth == FAKE_READ_BW  # the better of read and copy
    assert first.peak_flops == {"fp32": FAKE_FLOPS}
    assert fake_cpu.probes == ["full", "full"] and fake_cpu.flops_calls == ["fp32"]
    read = _entry(cache_dir)["figures"]["read"]
    assert read["value"] == FAKE_READ_BW and read["quiet"] and read["probe"] == "full"
    assert read["others_fraction"] == 0.0 and "measured_at" in read

    again = cpu.cpu_device()  # cached: a quick re-probe of each figure, no full one
    assert again.memory_bandwidth == first.memory_bandwidth
    assert fake_cpu.probes == ["full", "full", "quick", "quick"]

    cpu.cpu_device(("bf16",))  # a new dtype gets its full matmul probe
    assert fake_cpu.probes[-2:] == ["quick", "full"] and fake_cpu.flops_calls[-1] == "bf16"
    cpu.cpu_device(refresh=True)  # forgets the figures: full again
    assert fake_cpu.probes[-2:] == ["full", "full"]
    assert len(_entry(cache_dir)["probes"]) == cpu.PROBE_HISTORY


def test_a_probe_under_load_never_replaces_a_quiet_figure(
    cache_dir: Path, fake_cpu: FakeCpu
) -> None:
    cpu.cpu_device()
    fake_cpu.others_fraction = 0.5  # a build on the other core
    fake_cpu.read_bw, fake_cpu.matmul_flops = FAKE_READ_BW / 2, FAKE_FLOPS / 4
    peaks = cpu.measure_cpu_peaks()
    assert (peaks.read_bandwidth, peaks.flops["fp32"]) == (FAKE_READ_BW, FAKE_FLOPS)
    assert not peaks.under_load
    last = _entry(cache_dir)["probes"][-1]
    assert last["quiet"] is False and last["others_fraction"] == 0.5  # recorded all the same


def test_a_figure_taken_under_load_is_flagged_and_replaced_by_the_next_quiet_probe(
    cache_dir: Path, fake_cpu: FakeCpu
) -> None:
    fake_cpu.others_fraction = 0.6
    fake_cpu.read_bw = 13.8e9  # what the busy machine of issue 33 cached
    busy = cpu.measure_cpu_peaks()
    assert busy.read_bandwidth == 13.8e9, "the only figure there is, until a quiet one"
    assert busy.under_load and busy.others_fraction == 0.6
    assert _entry(cache_dir)["figures"]["read"]["quiet"] is False

    fake_cpu.others_fraction = 0.0
    fake_cpu.read_bw = 12e9  # a quiet probe lower than the busy one still replaces it
    quiet = cpu.measure_cpu_peaks()
    assert fake_cpu.probes[-2:] == ["quick", "quick"]  # cached, if busy: a quick probe
    assert quiet.read_bandwidth == 12e9 and not quiet.under_load
    fake_cpu.read_bw = 30e9
    assert cpu.measure_cpu_peaks().read_bandwidth == 30e9  # the higher quiet figure wins
    assert fake_cpu.probes[-2:] == ["quick", "quick"]
    fake_cpu.read_bw = 25e9
    assert cpu.measure_cpu_peaks().read_bandwidth == 30e9  # and stays: best, not latest


def test_load_is_the_time_other_processes_used_not_our_own(monkeypatch) -> None:
    """The probe's own CPU time counts for nothing; the others' share of all CPUs decides."""
    samples = iter(
        [
            cpu.CpuTimes(wall_s=0.0, busy_s=100.0, self_s=5.0, num_cpus=4),
            # 2 s on 4 CPUs: busy rose 3.0 CPU-s, 2.6 of them ours: others 0.4 / 8 = 5 %.
            cpu.CpuTimes(wall_s=2.0, busy_s=103.0, self_s=7.6, num_cpus=4),
        ]
    )
    monkeypatch.setattr(cpu, "read_cpu_times", lambda: next(samples))
    result, load = cpu._timed_under_load(lambda x: x * 2, 21)
    assert result == 42 and load.others_fraction == pytest.approx(0.05) and load.quiet
    samples = iter([cpu.CpuTimes(0.0, 0.0, 0.0, 2), cpu.CpuTimes(1.0, 1.0, 0.0, 2)])
    assert not cpu._timed_under_load(lambda: None)[1].quiet  # one of two CPUs busy elsewhere
    samples = iter([cpu.CpuTimes(0.0, None, 0.0, 2), cpu.CpuTimes(1.0, None, 0.0, 2)])
    unknown = cpu._timed_under_load(lambda: None)[1]
    assert unknown.others_fraction is None and unknown.quiet  # no /proc/stat: nothing says busy


def test_the_real_cpu_clocks_move() -> None:
    before = REAL_READ_CPU_TIMES()  # the fixture fakes cpu.read_cpu_times
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:  # spin: our own time, not the others'
        pass
    after = REAL_READ_CPU_TIMES()
    assert after.self_s - before.self_s > 0.05 and after.num_cpus >= 1
    assert before.busy_s is not None and after.busy_s >= before.busy_s


def test_cache_is_per_machine_fingerprint(
    cache_dir: Path, fake_cpu: FakeCpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu.cpu_device()
    monkeypatch.setattr(cpu, "cpu_fingerprint", lambda: "another machine")
    cpu.cpu_device()
    assert fake_cpu.probes == ["full", "full", "full", "full"]
    assert len(json.loads((cache_dir / cpu.CACHE_FILE).read_text())) == 2


def test_figures_cached_before_loads_were_recorded_count_as_taken_under_load(
    cache_dir: Path, fake_cpu: FakeCpu
) -> None:
    """The old cache format (bare numbers, no load): replaced by the first quiet probe even
    when that reads lower, and a read figure from older read probes is measured again."""
    cache_dir.mkdir(parents=True)
    old = {
        "read_bandwidth": 40e9,
        "copy_bandwidth": 1.0,
        "flops": {"fp32": 500e9},
        "measured_at": "2026-01-01T00:00:00+00:00",
        "read_probes_version": cpu.READ_PROBES_VERSION,
    }
    (cache_dir / cpu.CACHE_FILE).write_text(json.dumps({cpu.cpu_fingerprint(): old}))
    peaks = cpu.measure_cpu_peaks()
    assert fake_cpu.probes == ["quick", "quick"]
    assert (peaks.read_bandwidth, peaks.flops["fp32"]) == (FAKE_READ_BW, FAKE_FLOPS)
    del old["read_probes_version"]
    (cache_dir / cpu.CACHE_FILE).write_text(json.dumps({cpu.cpu_fingerprint(): old}))
    assert cpu._entry_figures(old).keys() == {"flops:fp32"}


def test_a_corrupt_cache_is_measured_over(cache_dir: Path, fake_cpu: FakeCpu) -> None:
    cache_dir.mkdir(parents=True)
    (cache_dir / cpu.CACHE_FILE).write_text("{not json")
    assert cpu.cpu_device().memory_bandwidth == FAKE_READ_BW
    assert fake_cpu.probes == ["full", "full"]


def test_real_measurements_are_positive_and_plausible() -> None:
    # The real functions, captured at import before the fixture patched the module, on
    # small sizes and without a time budget so the test stays fast.
    read, copy = REAL_MEASURE_BANDWIDTH(num_bytes=8 << 20, repeats=2, budget_s=0.0)
    assert 1e8 < read < 1e13 and 1e8 < copy < 1e13
    flops = REAL_MEASURE_FLOPS("fp32", n=128, repeats=2, budget_s=0.0)
    assert 1e8 < flops < 1e14


def test_no_re_probe_when_every_figure_is_quiet_and_the_machine_is_busy_now(
    cache_dir: Path, fake_cpu: FakeCpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe under load could change no quiet figure: a busy start skips it."""
    cpu.measure_cpu_peaks()
    monkeypatch.setattr(cpu, "load_now", lambda: cpu.ProbeLoad(0.5, 3.0))
    peaks = cpu.measure_cpu_peaks()
    assert fake_cpu.probes == ["full", "full"] and peaks.read_bandwidth == FAKE_READ_BW
    assert cpu.measure_cpu_peaks(("bf16",)).flops["bf16"] == FAKE_FLOPS  # a missing figure
    assert fake_cpu.probes[-1] == "full"
