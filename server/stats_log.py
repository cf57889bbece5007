"""The periodic summary log line of the serving loop (``--stats-log-interval``): prompt and
generation throughput, queue sizes, KV usage, preemptions, MBU and the share of step time
spent outside the model, over the window since the last line. Fed by ``server/metrics.py``
after every engine step, on the event loop thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from engine.outputs import STEP_PHASES, StepStats


class StatsLog:
    """Owns the window's token, preemption and step-phase sums, and writes the line.

    Args:
        interval_s: period of the line; 0 (or less) disables it.
        logger: where the line goes (``server.metrics``'s logger, the name operators filter on).
    """

    def __init__(self, interval_s: float, logger: logging.Logger) -> None:
        self._interval_s = interval_s
        self._logger = logger
        self._window_start = time.monotonic()
        self._window_prompt_tokens = 0
        self._window_generation_tokens = 0
        self._window_phase_s = dict.fromkeys(STEP_PHASES, 0.0)
        self._num_preemptions = 0
        self._last_step: StepStats | None = None

    def add(self, stats: StepStats, last_mbu: float | None) -> None:
        """Count one engine step; log if the interval has passed. ``last_mbu`` is the MBU of
        the latest step that had one (None without a known peak bandwidth)."""
        for phase, seconds in stats.phase_s.items():
            self._window_phase_s[phase] = self._window_phase_s.get(phase, 0.0) + seconds
        self._num_preemptions += stats.num_preemptions
        self._window_prompt_tokens += stats.num_prefill_tokens
        self._window_generation_tokens += stats.num_decode_tokens
        self._last_step = stats
        self._maybe_log(last_mbu)

    def _maybe_log(self, last_mbu: float | None) -> None:
        if self._interval_s <= 0:
            return
        now = time.monotonic()
        elapsed = now - self._window_start
        if elapsed < self._interval_s:
            return
        stats = self._last_step
        assert stats is not None
        kv_usage = stats.num_kv_blocks_used / max(stats.num_kv_blocks_total, 1)
        mbu = f"{100 * last_mbu:.1f}%" if last_mbu is not None else "n/a"
        self._logger.info(
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
            "running: %d, waiting: %d, KV usage: %.1f%% (%d/%d blocks), preemptions: %d, "
            "MBU (last step): %s, step time outside the model: %s",
            self._window_prompt_tokens / elapsed,
            self._window_generation_tokens / elapsed,
            stats.num_running,
            stats.num_waiting,
            100 * kv_usage,
            stats.num_kv_blocks_used,
            stats.num_kv_blocks_total,
            self._num_preemptions,
            mbu,
            overhead_summary(self._window_phase_s),
        )
        self._window_start = now
        self._window_prompt_tokens = 0
        self._window_generation_tokens = 0
        self._window_phase_s = dict.fromkeys(STEP_PHASES, 0.0)


def overhead_summary(phase_s: Mapping[str, float]) -> str:
    """``"7.9% (schedule 0.4%, prepare 1.2%, ...)"``: the share of step time spent outside
    the model's forward, and each phase's share; "n/a" before any step."""
    total = sum(phase_s.values())
    if total <= 0:
        return "n/a"
    parts = ", ".join(
        f"{phase.replace('_', ' ')} {100 * phase_s.get(phase, 0.0) / total:.1f}%"
        for phase in STEP_PHASES
        if phase != "forward"
    )
    return f"{100 * (1 - phase_s.get('forward', 0.0) / total):.1f}% ({parts})"
