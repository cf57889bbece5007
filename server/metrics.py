"""Request and step figures: the seam the Prometheus issue fills in.

Data flows in as plain values (STYLE 6): the engine client hands every ``StepStats`` to
``ServerMetrics.record_step`` and the route handlers hand a ``RequestTimings`` per finished
choice to ``record_request``, both on the event loop thread (so no locking is needed). Today
the figures feed running totals and a periodic vLLM-style log line (throughput, running and
waiting requests, KV usage); the metrics issue adds ``prometheus_client`` objects here — this
is the only module allowed to import it — without touching callers.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from engine.outputs import StepStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestTimings:
    """Timestamps of one engine request (one choice), all ``time.monotonic()``.

    ``arrival_time`` is when the HTTP request arrived, so TTFT includes tokenization and
    queueing, as clients measure it.
    """

    arrival_time: float
    num_prompt_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0
    finish_reason: str | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    def on_tokens(self, num_tokens: int, now: float) -> None:
        """Record ``num_tokens`` tokens that arrived together at ``now``."""
        if num_tokens <= 0:
            return
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now
        self.num_output_tokens += num_tokens

    def on_finish(self, reason: str, now: float) -> None:
        self.finish_reason = reason
        self.finish_time = now

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (vLLM bench's TPOT definition)."""
        if self.first_token_time is None or self.finish_time is None:
            return None
        if self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class MetricsTotals:
    """Cumulative figures since start (what Prometheus counters will expose)."""

    num_requests_by_reason: Counter[str] = field(default_factory=Counter)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    e2e_sum_s: float = 0.0
    e2e_count: int = 0


class ServerMetrics:
    """Collects request and step figures; logs a summary every ``log_interval_s``.

    Args:
        log_interval_s: period of the summary log line; 0 disables it.
    """

    def __init__(self, log_interval_s: float = 10.0) -> None:
        self.totals = MetricsTotals()
        self.last_step: StepStats | None = None
        self._log_interval_s = log_interval_s
        self._window_start = time.monotonic()
        self._window_prompt_tokens = 0
        self._window_generation_tokens = 0

    def record_step(self, stats: StepStats) -> None:
        self.last_step = stats
        self.totals.num_steps += 1
        self.totals.num_preemptions += stats.num_preemptions
        # Prefill tokens are counted per step (chunks included); generation per finished
        # request below would lag, so throughput comes from the steps.
        self._window_prompt_tokens += stats.num_prefill_tokens
        self._window_generation_tokens += stats.num_decode_tokens
        self._maybe_log()

    def record_request(self, timings: RequestTimings) -> None:
        totals = self.totals
        totals.num_requests_by_reason[timings.finish_reason or "unknown"] += 1
        totals.num_prompt_tokens += timings.num_prompt_tokens
        totals.num_generation_tokens += timings.num_output_tokens
        if timings.ttft_s is not None:
            totals.ttft_sum_s += timings.ttft_s
            totals.ttft_count += 1
        if timings.e2e_s is not None:
            totals.e2e_sum_s += timings.e2e_s
            totals.e2e_count += 1

    def _maybe_log(self) -> None:
        if self._log_interval_s <= 0:
            return
        now = time.monotonic()
        elapsed = now - self._window_start
        if elapsed < self._log_interval_s:
            return
        stats = self.last_step
        assert stats is not None
        kv_usage = stats.num_kv_blocks_used / max(stats.num_kv_blocks_total, 1)
        logger.info(
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
            "running: %d, waiting: %d, KV usage: %.1f%% (%d/%d blocks), preemptions: %d",
            self._window_prompt_tokens / elapsed,
            self._window_generation_tokens / elapsed,
            stats.num_running,
            stats.num_waiting,
            100 * kv_usage,
            stats.num_kv_blocks_used,
            stats.num_kv_blocks_total,
            self.totals.num_preemptions,
        )
        self._window_start = now
        self._window_prompt_tokens = 0
        self._window_generation_tokens = 0
