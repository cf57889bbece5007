"""MBU and MFU of each engine step, and their smoothed values: plain arithmetic on
``StepStats`` and the device's peaks; ``server/metrics.py`` exports the results.

Per step (figures from ``engine/cost.py`` and the KV pool):

    MBU = (weight bytes read + KV bytes read + KV bytes written) / step time / peak bandwidth
    MFU = (2 x matmul params x tokens + 2 x vocab x hidden x logit rows + attention) FLOPs
          / step time / peak FLOP/s

Step time is the engine's whole iteration (schedule, batch building, forward, sampling,
update), so the figures describe the serving loop, not a kernel in isolation. Smoothed values
are ratios of exponentially decayed sums over about ``SMOOTHING_S`` seconds of *busy* time:
idle time between steps does not lower them. The byte, FLOP and step-time counters let
PromQL recompute both over any window (``deploy/README.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.outputs import StepStats
from server.peaks import Peaks

SMOOTHING_S = 10.0


class _RatioEMA:
    """``sum(x) / sum(t)`` over exponentially decayed steps: a time-weighted average rate."""

    def __init__(self, time_constant_s: float) -> None:
        self._tau = time_constant_s
        self._num = 0.0
        self._den = 0.0

    def add(self, amount: float, duration_s: float) -> float:
        decay = math.exp(-duration_s / self._tau)
        self._num = self._num * decay + amount
        self._den = self._den * decay + duration_s
        return self._num / self._den if self._den > 0 else 0.0


@dataclass(frozen=True, slots=True)
class StepUtilization:
    """One step's rates; the ratios are None where the peak they divide by is unknown."""

    bandwidth: float  # bytes moved / step time
    flops_rate: float  # FLOPs / step time
    mbu: float | None = None
    mbu_smoothed: float | None = None
    mfu: float | None = None
    mfu_smoothed: float | None = None


class UtilizationTracker:
    """Turns each step's bytes and FLOPs into rates and utilizations; owns the smoothing.

    Args:
        peaks: peak bandwidth / FLOP/s; None or a missing figure leaves that ratio None.
    """

    def __init__(self, peaks: Peaks | None) -> None:
        self._peaks = peaks
        self._bandwidth_ema = _RatioEMA(SMOOTHING_S)
        self._flops_ema = _RatioEMA(SMOOTHING_S)

    def add(self, stats: StepStats) -> StepUtilization | None:
        """The step's figures, or None for a step without a duration (nothing to divide by)."""
        if stats.step_time_s <= 0:
            return None
        moved = stats.weight_bytes + stats.kv_bytes_read + stats.kv_bytes_written
        bandwidth = moved / stats.step_time_s
        flops_rate = stats.flops / stats.step_time_s
        smoothed_bandwidth = self._bandwidth_ema.add(moved, stats.step_time_s)
        smoothed_flops = self._flops_ema.add(stats.flops, stats.step_time_s)
        mbu = mbu_smoothed = mfu = mfu_smoothed = None
        peaks = self._peaks
        if peaks is not None and peaks.bandwidth:
            mbu = bandwidth / peaks.bandwidth
            mbu_smoothed = smoothed_bandwidth / peaks.bandwidth
        if peaks is not None and peaks.flops:
            mfu = flops_rate / peaks.flops
            mfu_smoothed = smoothed_flops / peaks.flops
        return StepUtilization(bandwidth, flops_rate, mbu, mbu_smoothed, mfu, mfu_smoothed)
