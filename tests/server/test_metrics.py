"""RequestTimings arithmetic and ServerMetrics totals, fed by real requests."""

from __future__ import annotations

import logging

from engine.outputs import StepStats
from server.metrics import RequestTimings, ServerMetrics


def test_request_timings() -> None:
    t = RequestTimings(arrival_time=10.0, num_prompt_tokens=5)
    t.on_tokens(1, 10.5)
    t.on_tokens(2, 10.7)
    t.on_tokens(1, 11.0)
    t.on_finish("length", 11.0)
    assert t.ttft_s == 0.5 and t.e2e_s == 1.0
    assert t.num_output_tokens == 4
    assert [round(x, 6) for x in t.inter_token_latencies] == [0.2, 0.3]
    assert abs(t.tpot_s - 0.5 / 3) < 1e-9


def test_single_token_request_has_no_tpot() -> None:
    t = RequestTimings(arrival_time=0.0)
    t.on_tokens(1, 1.0)
    t.on_finish("stop", 1.0)
    assert t.tpot_s is None and t.inter_token_latencies == []


async def test_totals_count_requests_and_tokens(serve) -> None:
    s = await serve()
    r = await s.http.post(
        "/v1/completions", json={"prompt": ["a b", "one"], "n": 2, "max_tokens": 3}
    )
    usage = r.json()["usage"]
    await s.wait_idle()
    totals = s.app.state.ctx.metrics.totals
    assert totals.num_requests_by_reason == {"length": 4}
    assert totals.num_generation_tokens == usage["completion_tokens"] == 12
    assert totals.ttft_count == 4 and totals.ttft_sum_s > 0
    assert totals.num_steps >= 3  # the step hook is wired by create_app


def test_summary_log_line(caplog) -> None:
    metrics = ServerMetrics(log_interval_s=1e-9)
    stats = StepStats(
        step_time_s=0.01,
        num_running=2,
        num_waiting=1,
        num_prefill_tokens=10,
        num_decode_tokens=2,
        num_preemptions=0,
        num_kv_blocks_used=3,
        num_kv_blocks_total=12,
    )
    with caplog.at_level(logging.INFO, logger="server.metrics"):
        metrics.record_step(stats)
    assert "running: 2, waiting: 1, KV usage: 25.0% (3/12 blocks)" in caplog.text
