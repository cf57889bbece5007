"""Statistics over request records: latency percentiles, throughput, goodput.

Definitions (also in loadtest/README.md):

- **TTFT** (time to first token): send -> first content chunk.
- **E2E**: send -> end of stream.
- **TPOT** (time per output token, one value per request):
  ``(e2e - ttft) / (output_tokens - 1)`` for requests with ``output_tokens > 1``; undefined
  (left out) otherwise. It averages the decode phase of one request.
- **ITL** (inter-token latency): every gap between consecutive content chunks, pooled over
  all completed requests. Unlike TPOT it shows stalls (a p99 ITL far above p50 TPOT means some
  steps were long, e.g. a prefill of a new request holding up everyone's decode).
- **Percentiles** interpolate linearly between the two nearest ranks (the "type 7" rule,
  numpy's default): for sorted x of length n and q in [0, 100], h = (n - 1) q / 100 and
  p_q = x[floor h] + (h - floor h) (x[ceil h] - x[floor h]).
- **Throughputs** divide by the point's wall-clock duration (first send to last completion)
  and count completed requests only (errors and cancellations produced no full answer).
- **Goodput**: completed requests that meet every SLO given (TTFT <= slo_ttft_s, TPOT <=
  slo_tpot_s, E2E <= slo_e2e_s), per second and as a fraction of the requests that count. A
  request with one output token has no TPOT and passes the TPOT SLO. Errors and time-limit
  cancellations count as misses; planned client hang-ups (``cancel_reason == "client"``) are
  left out of the fraction's denominator since they never wanted a full answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.client import RequestRecord

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objectives for goodput; ``None`` means "no limit on this one"."""

    ttft_s: float | None = 2.0
    tpot_s: float | None = 0.2
    e2e_s: float | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def tpot(record: RequestRecord) -> float | None:
    """(e2e - ttft) / (output_tokens - 1), or None when it is undefined."""
    if record.ttft_s is None or record.e2e_s is None or record.output_tokens <= 1:
        return None
    return (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)


def inter_token_latencies(record: RequestRecord) -> list[float]:
    """Gaps between consecutive content chunks of one request."""
    t = record.chunk_times_s
    return [t[i + 1] - t[i] for i in range(len(t) - 1)]


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """Whether a request completed and met every SLO (see module docstring)."""
    if not record.ok or record.ttft_s is None or record.e2e_s is None:
        return False
    if slo.ttft_s is not None and record.ttft_s > slo.ttft_s:
        return False
    value = tpot(record)
    if slo.tpot_s is not None and value is not None and value > slo.tpot_s:
        return False
    return slo.e2e_s is None or record.e2e_s <= slo.e2e_s


@dataclass(frozen=True, slots=True)
class Summary:
    """One sweep point's figures; field names are the result JSON's ``summary`` keys.

    Latency fields are ``{metric}_{stat}_s`` for metric in ttft/tpot/itl/e2e and stat in
    mean/p50/p90/p99/max; they are ``None`` when no completed request defines them.
    """

    num_requests: int
    num_completed: int
    num_errors: int
    num_cancelled: int
    error_rate: float
    duration_s: float
    request_throughput_req_s: float
    output_throughput_tok_s: float
    total_token_throughput_tok_s: float
    total_input_tokens: int
    total_output_tokens: int
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    max_concurrency: int
    goodput_req_s: float
    goodput_fraction: float | None
    slo_ttft_s: float | None
    slo_tpot_s: float | None
    slo_e2e_s: float | None
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    ttft_max_s: float | None
    tpot_mean_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    tpot_p99_s: float | None
    tpot_max_s: float | None
    itl_mean_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    itl_p99_s: float | None
    itl_max_s: float | None
    e2e_mean_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    e2e_p99_s: float | None
    e2e_max_s: float | None


def latency_stats(prefix: str, values: Sequence[float]) -> dict[str, float | None]:
    """``{prefix}_mean_s``, ``{prefix}_p50_s`` ... ``{prefix}_max_s`` for a list of seconds."""
    out: dict[str, float | None] = {}
    out[f"{prefix}_mean_s"] = sum(values) / len(values) if values else None
    for q in PERCENTILES:
        out[f"{prefix}_p{q}_s"] = percentile(values, q) if values else None
    out[f"{prefix}_max_s"] = max(values) if values else None
    return out


def _mean(values: Iterable[float]) -> float | None:
    xs = list(values)
    return sum(xs) / len(xs) if xs else None


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slo: SLO, max_concurrency: int = 0
) -> Summary:
    """Reduce one sweep point's records to its :class:`Summary`.

    Args:
        records: every request issued at this point (including failed and cancelled ones).
        duration_s: wall-clock time of the point (first send to last completion).
        slo: the objectives goodput is measured against.
        max_concurrency: the peak number of requests in flight, as observed by the runner.
    """
    completed = [r for r in records if r.ok]
    errors = [r for r in records if r.error is not None]
    cancelled = [r for r in records if r.cancelled]
    # Planned hang-ups never wanted a full answer, so they are neither hits nor misses.
    slo_population = [r for r in records if r.cancel_reason != "client"]
    num_good = sum(1 for r in slo_population if meets_slo(r, slo))
    # Fall back to the workload's estimate when the server did not report prompt usage.
    input_tokens = [
        r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in completed
    ]
    output_tokens = [r.output_tokens for r in completed]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    tpots = [v for v in (tpot(r) for r in completed) if v is not None]
    itls = [gap for r in completed for gap in inter_token_latencies(r)]
    fields: dict[str, Any] = {
        "num_requests": len(records),
        "num_completed": len(completed),
        "num_errors": len(errors),
        "num_cancelled": len(cancelled),
        "error_rate": len(errors) / len(records) if records else 0.0,
        "duration_s": duration_s,
        "request_throughput_req_s": len(completed) * per_s,
        "output_throughput_tok_s": sum(output_tokens) * per_s,
        "total_token_throughput_tok_s": (sum(input_tokens) + sum(output_tokens)) * per_s,
        "total_input_tokens": sum(input_tokens),
        "total_output_tokens": sum(output_tokens),
        "mean_prompt_tokens": _mean(input_tokens),
        "mean_output_tokens": _mean(output_tokens),
        "max_concurrency": max_concurrency,
        "goodput_req_s": num_good * per_s,
        "goodput_fraction": num_good / len(slo_population) if slo_population else None,
        "slo_ttft_s": slo.ttft_s,
        "slo_tpot_s": slo.tpot_s,
        "slo_e2e_s": slo.e2e_s,
    }
    fields.update(latency_stats("ttft", [r.ttft_s for r in completed if r.ttft_s is not None]))
    fields.update(latency_stats("tpot", tpots))
    fields.update(latency_stats("itl", itls))
    fields.update(latency_stats("e2e", [r.e2e_s for r in completed if r.e2e_s is not None]))
    return Summary(**fields)
