"""Reading the server's metrics: per-phase step time and the MBU gauge, defensively."""

from __future__ import annotations

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
