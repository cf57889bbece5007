"""Read what a server actually did: a loadtest result JSON or a live Prometheus ``/metrics``.

Result JSON. The schema is read loosely so that ``loadtest``'s results, vLLM's
``benchmark_serving.py`` output and hand-written files all work. The reader walks the JSON
and takes every object that has a TTFT, TPOT or output-throughput key as one measurement
(a sweep has one per point). Minimal schema (the keys of ``loadtest.stats.Summary``)::

    {"ttft_p50_s": 0.05, "tpot_p50_s": 0.021, "output_throughput_tok_s": 47.5,
     "concurrency": 1, "mean_prompt_tokens": 350, "mean_output_tokens": 150}

- a key names its metric by containing ``ttft`` / ``time_to_first_token``, ``tpot`` /
  ``time_per_output_token`` (``itl`` / ``inter_token`` as a fallback for TPOT), or
  ``output_throughput`` / ``output_tokens_per_s``; a nested ``{"ttft": {"p50": ...}}`` works;
- the statistic preferred is the median (``p50`` / ``median``), then the ``mean``;
- the ITL's p99 (``itl_p99_s``, vLLM's ``p99_itl_ms``, ``{"itl": {"p99": ...}}``) is read
  on its own, for the ITL latency target: a stalled step shows there, not in a median; and
  the ITL's median (``itl_p50_s``, vLLM's ``median_itl_ms``) for the ITL ratio target;
- values are seconds unless the key says ``ms`` (``median_ttft_ms``) or ``us``;
- the concurrency comes from ``concurrency`` / ``max_concurrency`` / ``batch`` in the object
  or an enclosing one (e.g. loadtest's ``point``), prompt and output lengths from keys with
  ``mean``/``avg`` and ``prompt``/``input`` or ``output`` plus ``tokens``/``len``.

Prometheus. ``pagedserve_time_to_first_token_seconds`` and
``pagedserve_time_per_output_token_seconds`` histograms give the median (interpolated in the
buckets, as PromQL's ``histogram_quantile``) and mean, and
``pagedserve_inter_token_latency_seconds`` the ITL's p99 and p50;
``pagedserve_generation_tokens_total`` divided by the scrape window gives throughput (only
with ``--window``, which scrapes twice).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Measured:
    """One measured operating point, in seconds and tokens/s; None where not measured."""

    source: str
    label: str
    ttft_s: float | None = None
    ttft_stat: str = ""
    tpot_s: float | None = None
    tpot_stat: str = ""
    output_tokens_per_s: float | None = None
    # The 99th percentile of every gap between two tokens of a request, pooled: what an ITL
    # target bounds (a TPOT median averages a stalled step away).
    itl_p99_s: float | None = None
    itl_p99_stat: str = ""
    itl_p50_s: float | None = None  # with the p99, what an ITL ratio target bounds
    itl_p50_stat: str = ""
    concurrency: int | None = None
    prompt_tokens: float | None = None
    output_tokens: float | None = None


# --------------------------------------------------------------------------- result JSON

_METRIC_PATTERNS = {
    "ttft": re.compile(r"ttft|time_to_first_token"),
    "tpot": re.compile(r"tpot|time_per_output_token"),
    "itl": re.compile(r"\bitl|_itl|inter_token"),
    "throughput": re.compile(
        r"output_throughput|output_tokens?_per_s|output_tok_s|"
        r"generation_throughput|generation_tokens?_per_s"
    ),
}
# Other statistics, SLO targets, and raw Prometheus samples copied into a result file.
_SKIP_STATS = re.compile(
    r"p\d\d?(?<!p50)\b|p\d\d?_|max|min|std|total|slo|goodput|bucket|"
    r"_sum\b|_count\b|\{"
)
# Set concurrency first; the observed peak in flight only if nothing set it.
_CONCURRENCY_KEYS = (("concurrency", "batch", "batch_size"), ("max_concurrency",))


def _unit_scale(key: str) -> float:
    if re.search(r"(^|_)ms($|_)|\(ms\)", key):
        return 1e-3
    if re.search(r"(^|_)us($|_)", key):
        return 1e-6
    return 1.0


def _stat_rank(key: str) -> int | None:
    """0 for a median, 1 for a mean, 2 for an unqualified value, None to skip."""
    if re.search(r"p50|median", key):
        return 0
    if _SKIP_STATS.search(key):
        return None
    if re.search(r"mean|avg|average", key):
        return 1
    return 2


def _flat_numbers(obj: dict[str, Any]) -> dict[str, float]:
    """The object's numeric values; ``{"ttft": {"p50": x}}`` becomes ``ttft_p50``."""
    out: dict[str, float] = {}
    for key, value in obj.items():
        k = str(key).lower()
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            out[k] = float(value)
        elif isinstance(value, dict) and any(p.search(k) for p in _METRIC_PATTERNS.values()):
            for sub, v in value.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    out[f"{k}_{str(sub).lower()}"] = float(v)
    return out


def _pick(numbers: dict[str, float], metric: str, timed: bool) -> tuple[int, float, str] | None:
    """(statistic rank, value in seconds or tokens/s, key) of the best key for ``metric``."""
    best: tuple[int, float, str] | None = None
    for key, value in numbers.items():
        if not _METRIC_PATTERNS[metric].search(key):
            continue
        rank = _stat_rank(key)
        if rank is None:
            continue
        scaled = value * (_unit_scale(key) if timed else 1.0)
        if best is None or rank < best[0]:
            best = (rank, scaled, key)
    return best


_P99 = re.compile(r"p99(?!\d)")
_P50 = re.compile(r"p50(?!\d)|median")
_NOT_A_SUMMARY = re.compile(r"slo|goodput|bucket|_sum\b|_count\b|\{")


def _pick_percentile(
    numbers: dict[str, float], metric: str, percentile: re.Pattern[str]
) -> tuple[float, str] | None:
    """(value in seconds, key) of ``metric``'s ``percentile`` (``_P99``, ``_P50``), if the
    object has one."""
    for key, value in numbers.items():
        if _METRIC_PATTERNS[metric].search(key) and percentile.search(key):
            if not _NOT_A_SUMMARY.search(key):
                return value * _unit_scale(key), key
    return None


def _length(numbers: dict[str, float], kind: str) -> float | None:
    words = ("prompt", "input") if kind == "prompt" else ("output", "completion")
    for key, value in numbers.items():
        if (
            any(w in key for w in words)
            and re.search(r"mean|avg", key)
            and re.search(r"token|len", key)
            and "throughput" not in key
        ):
            return value
    return None


def _walk(
    obj: Any, ancestors: tuple[dict[str, Any], ...], path: str
) -> Iterator[tuple[dict[str, Any], tuple[dict[str, Any], ...], str]]:
    if isinstance(obj, dict):
        yield obj, ancestors, path
        for key, value in obj.items():
            yield from _walk(value, (obj, *ancestors), f"{path}.{key}" if path else str(key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _walk(value, ancestors, f"{path}[{i}]")


def _concurrency(obj: dict[str, Any], ancestors: tuple[dict[str, Any], ...]) -> int | None:
    # Nearest first: the object, a "point"/"config" inside it, then enclosing objects.
    for keys in _CONCURRENCY_KEYS:
        for scope in (obj, *ancestors):
            for holder in (scope, *(v for v in scope.values() if isinstance(v, dict))):
                for key in keys:
                    value = holder.get(key)
                    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                        return int(value)
    return None


def _label(obj: dict[str, Any], ancestors: tuple[dict[str, Any], ...]) -> str | None:
    """A sweep point's name, e.g. loadtest's ``point.label`` ("concurrency=4")."""
    for scope in (obj, *ancestors):
        for holder in (scope, *(v for v in scope.values() if isinstance(v, dict))):
            if isinstance(holder.get("label"), str):
                return str(holder["label"])
    return None


def measurements_from_json(data: Any, source: str) -> list[Measured]:
    """Every measurement in a result JSON (one per sweep point), in document order.

    Objects with a statistic (median or mean) win over objects with bare values: a loadtest
    result also holds per-request records (``"ttft_s": 0.04``) and SLO targets, which are
    not summaries. A file holding only bare values is still read.
    """
    candidates: list[tuple[int, Measured]] = []
    for obj, ancestors, path in _walk(data, (), ""):
        numbers = _flat_numbers(obj)
        ttft = _pick(numbers, "ttft", timed=True)
        tpot = _pick(numbers, "tpot", timed=True) or _pick(numbers, "itl", timed=True)
        throughput = _pick(numbers, "throughput", timed=False)
        itl_p99 = _pick_percentile(numbers, "itl", _P99)
        itl_p50 = _pick_percentile(numbers, "itl", _P50)
        if ttft is None and tpot is None and throughput is None:
            continue
        best_rank = min(pick[0] for pick in (ttft, tpot) if pick) if (ttft or tpot) else 2
        candidates.append(
            (
                best_rank,
                Measured(
                    source=source,
                    label=_label(obj, ancestors) or path or "result",
                    ttft_s=ttft[1] if ttft else None,
                    ttft_stat=ttft[2] if ttft else "",
                    tpot_s=tpot[1] if tpot else None,
                    tpot_stat=tpot[2] if tpot else "",
                    output_tokens_per_s=throughput[1] if throughput else None,
                    itl_p99_s=itl_p99[0] if itl_p99 else None,
                    itl_p99_stat=itl_p99[1] if itl_p99 else "",
                    itl_p50_s=itl_p50[0] if itl_p50 else None,
                    itl_p50_stat=itl_p50[1] if itl_p50 else "",
                    concurrency=_concurrency(obj, ancestors),
                    prompt_tokens=_length(numbers, "prompt"),
                    output_tokens=_length(numbers, "output"),
                ),
            )
        )
    if any(rank < 2 for rank, _ in candidates):
        return [m for rank, m in candidates if rank < 2]
    return [m for _, m in candidates]


# ---------------------------------------------------------------------------- Prometheus


_LE_LABEL = re.compile(r'le="([^"]*)"')


@dataclass(slots=True)
class Histogram:
    buckets: dict[float, float]  # upper bound -> cumulative count, summed over label sets
    total: float
    count: float

    @classmethod
    def from_samples(cls, samples: Mapping[str, float] | None, name: str) -> Histogram | None:
        """Histogram ``name`` from flat samples (``{'name_bucket{le="0.1",...}': value}``,
        as ``loadtest.probe.parse_prometheus_text`` gives them), summed over label sets;
        None if it is not among them."""
        hist = cls({}, 0.0, 0.0)
        found = False
        for key, value in (samples or {}).items():
            series, _, labels = key.partition("{")
            if series == f"{name}_bucket":
                le = _LE_LABEL.search(labels)
                if le:
                    bound = float(le.group(1))  # "+Inf" parses as inf
                    hist.buckets[bound] = hist.buckets.get(bound, 0.0) + value
                    found = True
            elif series == f"{name}_sum":
                hist.total += value
            elif series == f"{name}_count":
                hist.count += value
        return hist if found else None

    def minus(self, before: Histogram | None) -> Histogram:
        if before is None:
            return self
        return Histogram(
            {le: c - before.buckets.get(le, 0.0) for le, c in self.buckets.items()},
            self.total - before.total,
            self.count - before.count,
        )

    def quantile(self, q: float) -> float | None:
        """PromQL's ``histogram_quantile``: linear interpolation inside the bucket."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le in sorted(self.buckets):
            cumulative = self.buckets[le]
            if cumulative >= rank:
                if le == float("inf"):
                    return lower  # the +Inf bucket has no width: the last finite bound
                width = cumulative - below
                return lower + (le - lower) * ((rank - below) / width if width > 0 else 1.0)
            lower, below = le, cumulative
        return lower

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None


@dataclass(slots=True)
class _Scrape:
    histograms: dict[str, Histogram]
    counters: dict[str, float]


def parse_prometheus(text: str) -> _Scrape:
    """Histograms and counters of a Prometheus text exposition, summed over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    histograms: dict[str, Histogram] = {}
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            hist = histograms.setdefault(family.name, Histogram({}, 0.0, 0.0))
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    hist.buckets[le] = hist.buckets.get(le, 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    hist.total += sample.value
                elif sample.name.endswith("_count"):
                    hist.count += sample.value
        elif family.type == "counter":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counters[family.name] = counters.get(family.name, 0.0) + sample.value
    return _Scrape(histograms, counters)


def _find(names: dict[str, Any], *patterns: str) -> str | None:
    """The first metric name containing a pattern, ``pagedserve_`` names preferred."""
    for pattern in patterns:
        matches = sorted(
            (n for n in names if pattern in n), key=lambda n: (not n.startswith("pagedserve_"), n)
        )
        if matches:
            return matches[0]
    return None


def measurement_from_prometheus(
    after: str, source: str, before: str | None = None, window_s: float | None = None
) -> Measured:
    """A measurement from one scrape (totals since start) or two (the window between them)."""
    now = parse_prometheus(after)
    then = parse_prometheus(before) if before is not None else None

    def hist(*patterns: str) -> tuple[Histogram | None, str]:
        name = _find(now.histograms, *patterns)
        if name is None:
            return None, ""
        return now.histograms[name].minus(then.histograms.get(name) if then else None), name

    def stat(h: Histogram | None, name: str) -> tuple[float | None, str]:
        if h is None or h.count <= 0:
            return None, ""
        return h.quantile(0.5), f"{name} p50 (histogram)"

    ttft_h, ttft_name = hist("time_to_first_token")
    tpot_h, tpot_name = hist("time_per_output_token", "inter_token_latency")
    e2e_h, _ = hist("e2e_request_latency", "request_latency", "e2e")
    ttft, ttft_stat = stat(ttft_h, ttft_name)
    tpot, tpot_stat = stat(tpot_h, tpot_name)
    itl_h, itl_name = hist("inter_token_latency")
    itl_p99 = itl_h.quantile(0.99) if itl_h is not None else None
    itl_p50, itl_p50_stat = stat(itl_h, itl_name)

    def counter_delta(*patterns: str) -> float | None:
        name = _find(now.counters, *patterns)
        if name is None:
            return None
        return now.counters[name] - (then.counters.get(name, 0.0) if then else 0.0)

    generated = counter_delta("generation_tokens")
    prompted = counter_delta("prompt_tokens")
    # Requests seen: the e2e histogram's count (finished), else TTFT's (at least started).
    seen = e2e_h if e2e_h is not None else ttft_h
    requests = seen.count if seen is not None else 0.0
    throughput = generated / window_s if generated is not None and window_s else None
    return Measured(
        source=source,
        label="window" if before is not None else "since server start",
        ttft_s=ttft,
        ttft_stat=ttft_stat,
        tpot_s=tpot,
        tpot_stat=tpot_stat,
        output_tokens_per_s=throughput,
        itl_p99_s=itl_p99,
        itl_p99_stat=f"{itl_name} p99 (histogram)" if itl_p99 is not None else "",
        itl_p50_s=itl_p50,
        itl_p50_stat=itl_p50_stat,
        prompt_tokens=prompted / requests if prompted is not None and requests > 0 else None,
        output_tokens=generated / requests if generated is not None and requests > 0 else None,
    )


def _fetch(url: str, timeout_s: float = 10.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (user's URL)
            body: bytes = response.read()
    except urllib.error.HTTPError as exc:
        raise ValueError(
            f"{url}: HTTP {exc.code}; does the server expose Prometheus metrics there?"
        ) from exc
    return body.decode("utf-8")


def load_measured(
    spec: str,
    *,
    window_s: float = 0.0,
    fetch: Callable[[str], str] = _fetch,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Measured]:
    """``--measured``: an ``http(s)://`` URL (``/metrics`` appended if missing) or a file.

    A file is read as JSON, and as Prometheus text if it is not JSON. With a URL and
    ``window_s > 0`` the server is scraped twice, ``window_s`` apart.
    """
    if spec.startswith(("http://", "https://")):
        url = spec if spec.rstrip("/").endswith("/metrics") else spec.rstrip("/") + "/metrics"
        first = fetch(url)
        if window_s <= 0:
            return [measurement_from_prometheus(first, url)]
        start = time.monotonic()
        sleep(window_s)
        second = fetch(url)
        elapsed = max(time.monotonic() - start, window_s)
        return [measurement_from_prometheus(second, url, before=first, window_s=elapsed)]
    text = Path(spec).expanduser().read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except ValueError:
        return [measurement_from_prometheus(text, spec)]
    found = measurements_from_json(data, spec)
    if not found:
        raise ValueError(f"{spec}: no TTFT, TPOT or output-throughput figure found")
    return found
