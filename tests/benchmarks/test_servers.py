"""Reading the server's metrics: per-phase step time and the MBU gauge, defensively."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.servers import overhead_fraction, phase_seconds, server_mbu


def phases(forward: float, other: float) -> dict[str, float]:
    m = 'model_name="default"'
    return {
        f'pagedserve_step_phase_seconds_total{{{m},phase="forward"}}': forward,
        f'pagedserve_step_phase_seconds_total{{{m},phase="schedule"}}': other / 2,
        f'pagedserve_step_phase_seconds_total{{{m},phase="between_steps"}}': other / 2,
        f'pagedserve_step_phase_seconds_created{{{m},phase="forward"}}': 1.7e9,
        "pagedserve_generation_tokens_total": 100.0,
    }


def test_phase_seconds_reads_a_counter_and_skips_created_stamps() -> None:
    assert phase_seconds(phases(3.0, 1.0)) == {
        "forward": 3.0,
        "schedule": 0.5,
        "between_steps": 0.5,
    }


def test_phase_seconds_reads_a_histogram_sum() -> None:
    metrics = {
        'x_step_phase_seconds_sum{phase="forward"}': 2.0,
        'x_step_phase_seconds_count{phase="forward"}': 7.0,
        'x_step_phase_seconds_bucket{phase="forward",le="0.1"}': 5.0,
    }
    assert phase_seconds(metrics) == {"forward": 2.0}


def test_overhead_fraction_is_taken_between_scrapes() -> None:
    # Before: 10 s forward, 10 s other; during the point: 8 s forward, 2 s other -> 20 %.
    assert overhead_fraction(phases(10.0, 10.0), phases(18.0, 12.0)) == pytest.approx(0.2)


def test_overhead_fraction_is_none_without_phase_metrics() -> None:
    plain = {"pagedserve_generation_tokens_total": 5.0}
    assert overhead_fraction(plain, plain) is None
    assert overhead_fraction(None, phases(1.0, 1.0)) is None
    assert overhead_fraction(phases(1.0, 1.0), phases(1.0, 1.0)) is None  # no step ran


def test_server_mbu_ignores_the_smoothed_gauge() -> None:
    metrics = {
        'pagedserve_mbu_smoothed{model_name="d"}': 0.1,
        'pagedserve_mbu{model_name="d"}': 0.4,
    }
    assert server_mbu(metrics) == 0.4
    assert server_mbu({"vllm:num_requests_running": 1.0}) is None
    assert server_mbu(None) is None


def test_server_mbu_is_the_median_of_the_scrapes_during_the_point() -> None:
    def scrape(value: float) -> dict[str, float]:
        return {'pagedserve_mbu{model_name="d"}': value}

    during = [scrape(0.7), scrape(0.2), scrape(0.72), scrape(0.69)]
    assert server_mbu(scrape(0.48), during) == 0.7
    # Fewer than 3 reads during the point: the one after it.
    assert server_mbu(scrape(0.48), during[:2]) == 0.48
    assert server_mbu(scrape(0.48), [{"vllm:num_requests_running": 1.0}] * 4) == 0.48


def _fake_server(tmp_path: Any) -> type:
    class FakeServer:
        base_url = "http://127.0.0.1:1"
        log_path = tmp_path / "log"

        def __init__(self, *args: Any) -> None:
            pass

        def start(self) -> None:
            pass

        def wait_healthy(self, timeout_s: float) -> float:
            return 0.0

        def stop(self) -> None:
            pass

    return FakeServer


def _fake_sweep(calls: list[str]) -> Any:
    summary = SimpleNamespace(
        num_errors=0,
        ttft_p50_s=0.1,
        tpot_p50_s=0.02,
        itl_p50_s=0.02,
        itl_p99_s=0.03,
        output_throughput_tok_s=50.0,
        num_completed=2,
        duration_s=3.0,
        mean_prompt_tokens=128.0,
        mean_output_tokens=64.0,
    )

    def fake_sweep(config: Any) -> Any:
        calls.append(f"point c={config.concurrencies[0]}")
        point = SimpleNamespace(summary=summary, server_metrics_after={}, server_metrics_during=[])
        return SimpleNamespace(points=[point], metrics_before={})

    return fake_sweep


def test_measure_server_probes_bandwidth_around_the_concurrency_1_point(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The bandwidth is probed right before and after the c=1 point only, and the point
    keeps both probes and the higher one."""
    from benchmarks import servers

    calls: list[str] = []
    probes = iter([30e9, 34e9])

    def probe() -> float:
        calls.append("probe")
        return next(probes)

    monkeypatch.setattr(servers, "ServerProcess", _fake_server(tmp_path))
    monkeypatch.setattr(servers, "run_sweep", _fake_sweep(calls))
    out = servers.measure_server(
        "fake",
        "python -m x --port {port}",
        tmp_path,
        [1, 16],
        128,
        64,
        4,
        tmp_path,
        1.0,
        probe_bandwidth=probe,
    )
    assert calls == ["probe", "point c=1", "probe", "point c=16"]
    assert out["points"]["1"]["bandwidth_probes_bytes_s"] == [30e9, 34e9]
    assert out["points"]["1"]["bandwidth_bytes_s"] == 34e9
    assert out["points"]["1"]["bandwidth_steady"] is True
    assert out["points"]["1"]["bandwidth_attempts"] == 1
    assert "bandwidth_bytes_s" not in out["points"]["16"]


@pytest.mark.parametrize(
    "probes,runs,steady",
    [
        # moved during the first run (36 -> 62 GB/s), not during the second: keep the second
        ([36e9, 62e9, 60e9, 61e9], 2, True),
        # moved during every run: the last is kept, marked unsteady
        ([36e9, 62e9, 62e9, 35e9, 34e9, 60e9], 3, False),
    ],
)
def test_measure_server_runs_the_concurrency_1_point_again_while_bandwidth_moves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, probes: list[float], runs: int, steady: bool
) -> None:
    from benchmarks import servers

    calls: list[str] = []
    monkeypatch.setattr(servers, "ServerProcess", _fake_server(tmp_path))
    monkeypatch.setattr(servers, "run_sweep", _fake_sweep(calls))
    readings = iter(probes)

    def probe() -> float:
        calls.append("probe")
        return next(readings)

    out = servers.measure_server(
        "fake", "python -m x --port {port}", tmp_path, [1], 128, 64, 4, tmp_path, 1.0, probe
    )
    assert calls == ["probe", "point c=1", "probe"] * runs
    point = out["points"]["1"]
    assert point["bandwidth_probes_bytes_s"] == probes[-2:]
    assert point["bandwidth_attempts"] == runs
    assert point["bandwidth_steady"] is steady


def test_server_histogram_quantile_interpolates_between_two_scrapes() -> None:
    """Prometheus' histogram_quantile over the observations between two scrapes of a real
    exposition: 10 inter-token gaps before, then 90 of 4-5 ms and 10 of 40-50 ms."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from benchmarks.servers import ITL_METRIC, server_histogram_quantile
    from loadtest.probe import parse_prometheus_text
    from server.metrics import ITL_BUCKETS

    registry = CollectorRegistry()
    itl = Histogram(ITL_METRIC, "gaps", ["model_name"], buckets=ITL_BUCKETS, registry=registry)
    for _ in range(10):
        itl.labels("m").observe(2.0)  # before the first scrape: not counted
    before = parse_prometheus_text(generate_latest(registry).decode())
    for i in range(90):
        itl.labels("m").observe(0.004 + i * 1e-5)
    for _ in range(10):
        itl.labels("m").observe(0.045)
    after = parse_prometheus_text(generate_latest(registry).decode())
    p50 = server_histogram_quantile(before, after, ITL_METRIC, 0.5)
    p99 = server_histogram_quantile(before, after, ITL_METRIC, 0.99)
    assert p50 is not None and 0.0025 < p50 <= 0.005  # its bucket: (2.5, 5] ms
    assert p99 is not None and 0.04 < p99 <= 0.05  # (40, 50] ms
    assert server_histogram_quantile(after, after, ITL_METRIC, 0.5) is None  # none between
    assert server_histogram_quantile(None, None, ITL_METRIC, 0.5) is None


def test_the_histograms_read_are_the_ones_the_server_exports() -> None:
    """The server-side ITL and TTFT the HTTP rows print come from these names."""
    from benchmarks.servers import ITL_METRIC, TTFT_METRIC
    from server.metrics import ServerMetrics

    text = ServerMetrics("m").exposition(None)[0].decode()
    for name in (ITL_METRIC, TTFT_METRIC):
        assert f"{name}_bucket{{" in text, name
