"""LoadTestConfig: everything one sweep needs, parsed once from the command line."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loadtest.distributions import LengthDist
from loadtest.stats import SLO


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One point of a sweep: a closed-loop concurrency, an open-loop rate, or a trace replay."""

    kind: str  # "concurrency" | "rate" | "trace"
    concurrency: int | None = None
    request_rate: float | None = None  # requests/s; math.inf sends all at once
    burstiness: float = 1.0

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency={self.concurrency}"
        if self.kind == "rate":
            rate = (
                "inf"
                if self.request_rate is None or math.isinf(self.request_rate)
                else (f"{self.request_rate:g}")
            )
            burst = f",burstiness={self.burstiness:g}" if self.burstiness != 1.0 else ""
            return f"rate={rate}{burst}"
        return "trace"

    def to_json(self) -> dict[str, Any]:
        rate = self.request_rate
        return {
            "kind": self.kind,
            "label": self.label,
            "concurrency": self.concurrency,
            # JSON has no infinity; "inf" keeps the intent readable.
            "request_rate": "inf" if rate is not None and math.isinf(rate) else rate,
            "burstiness": self.burstiness,
        }


@dataclass(frozen=True, slots=True)
class LoadTestConfig:
    """Args:
    base_url: server root (``http://host:port``), without ``/v1``.
    model: ``model`` sent with requests; ``None`` asks ``GET /v1/models`` for the first one.
    concurrencies: closed-loop sweep (mutually exclusive with request_rates and trace_path).
    request_rates: open-loop sweep in requests/s (``math.inf``: all at once).
    burstiness: gamma shape of open-loop inter-arrival gaps (1.0 = Poisson).
    max_concurrency: optional client-side cap on requests in flight in open loop.
    trace_path: JSONL trace to replay (see ``workloads.load_trace``).
    trace_time_scale: replay speed-up for the trace.
    num_requests: requests per sweep point.
    duration_limit_s: no new request is sent after this many seconds of a point.
    drain_timeout_s: after the duration limit, how long in-flight requests may still run
        before they are cancelled (recorded as ``cancel_reason="time_limit"``).
    prompt_len / output_len: length distribution specs (``distributions.LengthDist``).
    workload: "synthetic" (random words of ``prompt_len`` tokens) or "grounded" (copy a
        passage of Python's documentation: ``workloads.grounded_workload``; ``prompt_len``,
        the shared prefix and cancellations do not apply).
    shared_prefix_len / num_prefixes: shared "system prompt" workload (0 = off).
    cancel_fraction: fraction of requests the client abandons mid-stream.
    seed: one seed for workload and arrival times.
    prompt_salt: varies the prompts' words, not their lengths (``synthetic_workload``'s
        ``text_salt``; each point adds its own index): two runs against one server that
        must not share prompts (a point measured again) give different salts.
    ignore_eos / temperature / extra_body / api_key / request_timeout_s: request options.
    slo: goodput objectives.
    warmup_requests: short unrecorded requests sent before the sweep (first-request costs).
    calibrate_tokens: use the server's ``/tokenize`` (if any) to size prompts.
    scrape_metrics: record ``GET /metrics`` before the sweep and after each point, if served.
    metrics_interval_s: also scrape it this often during a point, as a Prometheus would, so
        that a gauge of one step (a server's last-step MBU) is read over the point, not only
        at its end; 0 turns this off.
    progress: show a progress bar on stderr.
    """

    base_url: str
    model: str | None = None
    concurrencies: tuple[int, ...] = ()
    request_rates: tuple[float, ...] = ()
    burstiness: float = 1.0
    max_concurrency: int | None = None
    trace_path: str | None = None
    trace_time_scale: float = 1.0
    num_requests: int = 100
    duration_limit_s: float = 300.0
    drain_timeout_s: float = 60.0
    prompt_len: str = "uniform:64:192"
    output_len: str = "exponential:64:384"
    workload: str = "synthetic"
    shared_prefix_len: int = 0
    num_prefixes: int = 1
    cancel_fraction: float = 0.0
    seed: int = 0
    prompt_salt: str = ""
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout_s: float = 600.0
    slo: SLO = field(default_factory=SLO)
    warmup_requests: int = 1
    calibrate_tokens: bool = True
    scrape_metrics: bool = True
    metrics_interval_s: float = 2.0
    progress: bool = True

    def __post_init__(self) -> None:
        modes = sum([bool(self.concurrencies), bool(self.request_rates), bool(self.trace_path)])
        if modes != 1:
            raise ValueError("give exactly one of concurrencies, request_rates or trace_path")
        if self.workload not in ("synthetic", "grounded"):
            raise ValueError(f"workload must be synthetic or grounded, got {self.workload!r}")
        if any(c < 1 for c in self.concurrencies):
            raise ValueError(f"concurrency must be >= 1, got {self.concurrencies}")
        if any(r <= 0 for r in self.request_rates):
            raise ValueError(f"request rate must be positive, got {self.request_rates}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration_limit_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("duration_limit_s must be positive and drain_timeout_s >= 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not 0.0 <= self.cancel_fraction <= 1.0:
            raise ValueError(f"cancel_fraction must be in [0, 1], got {self.cancel_fraction}")
        # Fail at parse time, not after the server has been probed.
        LengthDist.parse(self.prompt_len)
        LengthDist.parse(self.output_len)

    def points(self) -> list[SweepPoint]:
        """The sweep points, in the order they run."""
        if self.concurrencies:
            return [SweepPoint("concurrency", concurrency=c) for c in self.concurrencies]
        if self.request_rates:
            return [
                SweepPoint("rate", request_rate=r, burstiness=self.burstiness)
                for r in self.request_rates
            ]
        return [SweepPoint("trace")]

    def to_json(self) -> dict[str, Any]:
        """JSON-safe copy for the result file (the API key is never written out)."""
        return {
            "base_url": self.base_url,
            "model": self.model,
            "concurrencies": list(self.concurrencies),
            "request_rates": ["inf" if math.isinf(r) else r for r in self.request_rates],
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
            "trace_path": self.trace_path,
            "trace_time_scale": self.trace_time_scale,
            "num_requests": self.num_requests,
            "duration_limit_s": self.duration_limit_s,
            "drain_timeout_s": self.drain_timeout_s,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "shared_prefix_len": self.shared_prefix_len,
            "num_prefixes": self.num_prefixes,
            "cancel_fraction": self.cancel_fraction,
            "workload": self.workload,
            "seed": self.seed,
            "prompt_salt": self.prompt_salt,
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "extra_body": dict(self.extra_body),
            "api_key_set": self.api_key is not None,
            "request_timeout_s": self.request_timeout_s,
            "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s, "e2e_s": self.slo.e2e_s},
            "warmup_requests": self.warmup_requests,
            "calibrate_tokens": self.calibrate_tokens,
            "scrape_metrics": self.scrape_metrics,
            "metrics_interval_s": self.metrics_interval_s,
        }
