"""Reading measurements: loadtest-style and vLLM-style result JSON, Prometheus text."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from planner.measured import load_measured, measurement_from_prometheus, measurements_from_json

BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def _summary(
    ttft: float, tpot: float, tps: float, concurrency: int, itl_p99: float
) -> dict[str, Any]:
    return {
        "num_requests": 8,
        "num_completed": 8,
        "output_throughput_tok_s": tps,
        "total_token_throughput_tok_s": 5 * tps,
        "mean_prompt_tokens": 350.0,
        "mean_output_tokens": 150.0,
        "max_concurrency": concurrency,
        "slo_ttft_s": 2.0,
        "slo_tpot_s": 0.2,
        "ttft_mean_s": ttft * 1.2,
        "ttft_p50_s": ttft,
        "ttft_p99_s": 9.0,
        "ttft_max_s": 9.5,
        "tpot_mean_s": tpot * 1.1,
        "tpot_p50_s": tpot,
        "tpot_p90_s": 8.0,
        "itl_p50_s": tpot * 0.9,
        "itl_p90_s": itl_p99 * 0.5,
        "itl_p99_s": itl_p99,
        "itl_max_s": itl_p99 * 2,
    }


def _loadtest_result() -> dict[str, Any]:
    """The shape of ``loadtest.run.SweepResult.to_json``: points with summaries and records."""

    def point(
        concurrency: int, ttft: float, tpot: float, tps: float, itl_p99: float
    ) -> dict[str, Any]:
        return {
            "point": {
                "kind": "concurrency",
                "label": f"concurrency={concurrency}",
                "concurrency": concurrency,
            },
            "summary": _summary(ttft, tpot, tps, concurrency, itl_p99),
            "server_metrics_after": {
                'pagedserve_time_to_first_token_seconds_bucket{le="0.1"}': 3.0,
                "pagedserve_time_to_first_token_seconds_sum": 0.4,
            },
            "requests": [
                {"index": i, "ttft_s": 7.0, "e2e_s": 8.0, "output_tokens": 150} for i in range(3)
            ],
        }

    return {
        "schema_version": 1,
        "config": {
            "concurrencies": [1, 4],
            "max_concurrency": None,
            "slo": {"ttft_s": 2.0, "tpot_s": 0.2, "e2e_s": None},
        },
        # At concurrency 4 a stalled step shows in the ITL p99, three times the TPOT median.
        "points": [point(1, 0.15, 0.03, 30.0, 0.035), point(4, 0.25, 0.04, 95.0, 0.12)],
    }


def test_loadtest_sweep_gives_one_measurement_per_point() -> None:
    found = measurements_from_json(_loadtest_result(), "r.json")
    assert [m.label for m in found] == ["concurrency=1", "concurrency=4"]
    one, four = found
    # Medians are preferred over means; records, SLOs and raw samples are not summaries.
    assert (one.ttft_s, one.tpot_s, one.output_tokens_per_s) == (0.15, 0.03, 30.0)
    assert one.ttft_stat == "ttft_p50_s" and one.tpot_stat == "tpot_p50_s"
    # The ITL's p99 is read beside them, for the ITL target; not its p90, max or an SLO.
    assert (one.itl_p99_s, four.itl_p99_s, four.itl_p99_stat) == (0.035, 0.12, "itl_p99_s")
    # And its median, for the ITL ratio target (the p99 over it).
    assert four.itl_p50_s == pytest.approx(0.036) and four.itl_p50_stat == "itl_p50_s"
    assert (four.concurrency, four.prompt_tokens, four.output_tokens) == (4, 350.0, 150.0)


def test_real_loadtest_summary_fields_are_understood() -> None:
    stats = pytest.importorskip("loadtest.stats")
    names = [f.name for f in fields(stats.Summary)]
    summary = {name: 1.0 for name in names}
    summary.update(
        ttft_p50_s=0.11,
        tpot_p50_s=0.022,
        output_throughput_tok_s=44.0,
        mean_prompt_tokens=100.0,
        mean_output_tokens=50.0,
        max_concurrency=2,
    )
    (m,) = measurements_from_json(
        {"points": [{"point": {"label": "c=2", "concurrency": 2}, "summary": summary}]}, "x"
    )
    assert (m.ttft_s, m.tpot_s, m.output_tokens_per_s) == (0.11, 0.022, 44.0)
    assert (m.concurrency, m.prompt_tokens, m.output_tokens) == (2, 100.0, 50.0)


def test_vllm_benchmark_serving_result_in_milliseconds() -> None:
    data = {
        "max_concurrency": 8,
        "median_ttft_ms": 120.0,
        "mean_ttft_ms": 150.0,
        "p99_ttft_ms": 900.0,
        "mean_tpot_ms": 25.0,
        "median_itl_ms": 20.0,
        "p99_itl_ms": 180.0,
        "output_throughput": 310.0,
        "total_token_throughput": 900.0,
    }
    (m,) = measurements_from_json(data, "vllm.json")
    assert m.ttft_s == pytest.approx(0.12)
    assert m.tpot_s == pytest.approx(0.025)  # TPOT preferred over ITL
    assert m.itl_p99_s == pytest.approx(0.18) and m.itl_p99_stat == "p99_itl_ms"
    assert m.itl_p50_s == pytest.approx(0.02) and m.itl_p50_stat == "median_itl_ms"
    assert m.output_tokens_per_s == 310.0
    assert m.concurrency == 8


def test_minimal_and_nested_schemas() -> None:
    (bare,) = measurements_from_json({"ttft_s": 0.5, "tpot_s": 0.05, "batch": 2}, "m")
    assert (bare.ttft_s, bare.tpot_s, bare.concurrency) == (0.5, 0.05, 2)
    assert bare.itl_p99_s is None  # no ITL percentile: the ITL target falls back to TPOT
    assert bare.itl_p50_s is None  # and the ratio target has no figure
    (nested,) = measurements_from_json(
        {"ttft": {"p50_ms": 40, "p99_ms": 90}, "tpot": {"mean": 0.01}, "itl": {"p99_ms": 70}},
        "n",
    )
    assert nested.ttft_s == pytest.approx(0.04)
    assert nested.tpot_s == pytest.approx(0.01)
    assert nested.itl_p99_s == pytest.approx(0.07)
    (slo_only,) = measurements_from_json({"tpot_p50_s": 0.02, "slo_itl_p99_s": 0.1}, "s")
    assert slo_only.itl_p99_s is None  # a target is not a measurement


def _prometheus_text(
    ttfts: list[float], tpots: list[float], generated: int, itls: Sequence[float] = ()
) -> str:
    registry = CollectorRegistry()
    ttft = Histogram(
        "pagedserve_time_to_first_token_seconds",
        "TTFT",
        ["model_name"],
        buckets=BUCKETS,
        registry=registry,
    )
    tpot = Histogram(
        "pagedserve_time_per_output_token_seconds",
        "TPOT",
        ["model_name"],
        buckets=BUCKETS,
        registry=registry,
    )
    itl = Histogram(
        "pagedserve_inter_token_latency_seconds",
        "ITL",
        ["model_name"],
        buckets=BUCKETS,
        registry=registry,
    )
    tokens = Counter("pagedserve_generation_tokens", "generated", ["model_name"], registry=registry)
    prompt = Counter("pagedserve_prompt_tokens", "prompted", ["model_name"], registry=registry)
    for value in ttfts:
        ttft.labels("m").observe(value)
    for value in tpots:
        tpot.labels("m").observe(value)
    for value in itls:
        itl.labels("m").observe(value)
    tokens.labels("m").inc(generated)
    prompt.labels("m").inc(100 * len(ttfts))
    return generate_latest(registry).decode()


def test_prometheus_histograms_median_and_means() -> None:
    # TTFT: 4 of 8 observations in (0.05, 0.1] and 4 in (0.1, 0.2]; the median is the 0.1
    # boundary, as PromQL's histogram_quantile interpolates it.
    # ITL: 98 gaps in (0.01, 0.02] and 2 stalls in (0.5, 1.0]; rank 99 of 100 lies halfway
    # through the stalls' bucket.
    itls = [0.015] * 98 + [0.7] * 2
    text = _prometheus_text([0.08] * 4 + [0.15] * 4, [0.015] * 10 + [0.03] * 10, 800, itls)
    m = measurement_from_prometheus(text, "metrics.txt")
    assert m.itl_p99_s == pytest.approx(0.75)
    assert m.itl_p99_stat == "pagedserve_inter_token_latency_seconds p99 (histogram)"
    # Rank 50 of 100 lies 50/98 of the way through the gaps' (0.01, 0.02] bucket.
    assert m.itl_p50_s == pytest.approx(0.01 + 0.01 * 50 / 98)
    assert m.itl_p50_stat == "pagedserve_inter_token_latency_seconds p50 (histogram)"
    assert m.ttft_s == pytest.approx(0.1)
    assert m.tpot_s == pytest.approx(0.02)  # rank 10 of 20: top of the (0.01, 0.02] bucket
    assert m.output_tokens_per_s is None  # one scrape has totals, not a rate
    assert m.output_tokens == pytest.approx(100.0)  # 800 generated / 8 requests
    assert m.prompt_tokens == pytest.approx(100.0)


def test_prometheus_window_from_two_scrapes_via_url() -> None:
    before = _prometheus_text([0.5] * 4, [0.2] * 4, 100)
    after = _prometheus_text([0.5] * 4 + [0.015] * 6, [0.2] * 4 + [0.015] * 30, 700)
    scrapes = iter([before, after])
    urls: list[str] = []

    def fetch(url: str) -> str:
        urls.append(url)
        return next(scrapes)

    (m,) = load_measured("http://server:8000", window_s=2.0, fetch=fetch, sleep=lambda s: None)
    assert urls == ["http://server:8000/metrics"] * 2
    # Only the window's observations count: all 6 new TTFTs fell in (0.01, 0.02].
    assert 0.01 < m.ttft_s <= 0.02
    assert 0.01 < m.tpot_s <= 0.02
    assert m.output_tokens_per_s == pytest.approx(600 / 2.0, rel=0.05)


def test_load_measured_files(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    result.write_text(json.dumps(_loadtest_result()))
    assert len(load_measured(str(result))) == 2
    prom = tmp_path / "metrics.txt"
    prom.write_text(_prometheus_text([0.08], [0.015], 10))
    (m,) = load_measured(str(prom))
    assert m.ttft_s is not None and 0.05 < m.ttft_s <= 0.1
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"nothing": 1}))
    with pytest.raises(ValueError, match="no TTFT"):
        load_measured(str(empty))
