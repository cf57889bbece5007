"""benchmarks/contention.py: the ratio a point reports against the 2.2x target, and the
offline summary's medians per batch and team mode (no server, no model)."""

from __future__ import annotations

from benchmarks import contention
from benchmarks.contention import OfflineRun, Point, PrefillRun


def _point(quiet: float | None, busy: float | None) -> Point:
    return Point(1, quiet, busy, 100.0, 50.0, busy_cpu=1)


def test_point_ratio_and_missing_figures():
    assert _point(0.005, 0.0075).ratio == 1.5
    assert _point(None, 0.01).ratio is None
    assert _point(0.005, None).ratio is None
    assert "1.50x" in contention.format_point(_point(0.005, 0.0075))


def _run(batch: int, mode: str, busy: bool, step_ms: float) -> OfflineRun:
    return OfflineRun(batch, mode, busy, step_ms / 1e3, step_ms / 1e3, 0.0, 0.0, 1, 1.0, 0.5)


def test_offline_summary_takes_medians_per_batch_and_mode():
    runs = [
        _run(1, "adapt", False, 4.0),
        _run(1, "adapt", True, 6.0),
        _run(1, "adapt", False, 5.0),
        _run(1, "adapt", True, 8.0),
        _run(1, "adapt", False, 4.5),
        _run(1, "adapt", True, 7.0),
        _run(1, "team", False, 4.0),  # no busy run: no line
    ]
    (line,) = contention.offline_summary(runs)
    assert line.startswith("batch 1   adapt ")
    assert "4.50 ms" in line and "7.00 ms" in line and "1.56x" in line


def _prefill(tokens: int, mode: str, busy: bool, step_ms: float) -> PrefillRun:
    return PrefillRun(tokens, mode, busy, step_ms / 1e3, step_ms / 2e3, step_ms / 2e3, 1, 1.0, 0.5)


def test_prefill_summary_takes_medians_and_gives_throughput():
    runs = [
        _prefill(128, "adapt", False, 200.0),
        _prefill(128, "adapt", True, 400.0),
        _prefill(128, "adapt", False, 300.0),
        _prefill(128, "adapt", True, 500.0),
        _prefill(512, "team", False, 800.0),  # no busy run: no line
    ]
    assert runs[0].tok_s == 640.0
    (line,) = contention.prefill_summary(runs)
    assert line.startswith("prefill 128  adapt ")
    assert "250.0 ms (  512 tok/s)" in line and "450.0 ms (  284 tok/s)" in line
    assert "1.80x" in line
