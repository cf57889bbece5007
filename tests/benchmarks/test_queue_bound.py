"""benchmarks/queue_bound.py's arithmetic, on made-up outcomes and a made-up scrape (the soak
itself needs two real servers and minutes: `python -m benchmarks.queue_bound`)."""

from __future__ import annotations

import pytest

from benchmarks.queue_bound import Outcome, Run, _counter, _queue_buckets

SCRAPE = """\
# HELP pagedserve_request_queue_time_seconds HTTP arrival to the request's first engine step
pagedserve_request_queue_time_seconds_bucket{le="20.0",model_name="m"} 7.0
pagedserve_request_queue_time_seconds_bucket{le="30.0",model_name="m"} 9.0
pagedserve_request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 10.0
pagedserve_generation_tokens_total{model_name="m"} 320.0
pagedserve_generation_tokens_created{model_name="m"} 1.7e9
"""


def test_the_scrape_is_read_by_bucket_and_counter() -> None:
    assert _queue_buckets(SCRAPE) == {20.0: 7.0, 30.0: 9.0, float("inf"): 10.0}
    assert _counter(SCRAPE, "pagedserve_generation_tokens_total") == 320.0


def test_summary_counts_refusals_waits_and_the_window() -> None:
    run = Run("bounded", 30.0, rate=3.0, window_s=10.0, started_at=100.0)
    run.outcomes = [
        Outcome(100.0, 200, first_token_s=2.0, completed_at=105.0),
        Outcome(101.0, 200, first_token_s=31.0, completed_at=140.0),  # done after the window
        Outcome(102.0, 503, code="queue_too_long", retry_after="4"),
        Outcome(103.0, 503, code="queue_timeout", retry_after="30"),
        Outcome(104.0, 503, code="too_many_connections"),  # no Retry-After
        Outcome(105.0, 200, cancelled_at=125.0),  # cancelled before its first token
        Outcome(106.0, None, code="ReadError"),
    ]
    run.tokens_in_window = 250.0
    run.queue_buckets = {20.0: 1.0, 30.0: 2.0, float("inf"): 3.0}
    s = run.summary()
    assert (s["sent"], s["admitted"], s["completed"], s["refused_503"]) == (7, 3, 2, 3)
    assert s["refused_codes"] == {
        "queue_too_long": 1,
        "queue_timeout": 1,
        "too_many_connections": 1,
    }
    assert s["refused_with_retry_after_share"] == pytest.approx(2 / 3)
    assert s["other_errors"] == {"ReadError": 1}
    assert s["cancelled_at_drain"] == 1 and s["cancelled_before_first_token"] == 1
    assert s["first_token_wait_max_s"] == 31.0  # observed waits and the lower bound of 20 s
    assert s["queue_time_over_bound_share"] == pytest.approx(1 / 3)
    assert s["tokens_per_s"] == 25.0
    assert s["completed_per_s"] == pytest.approx(0.1)  # only the first finished in the window
