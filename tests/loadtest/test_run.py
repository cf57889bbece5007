"""arun_sweep end to end against the fake server (real uvicorn, real sockets)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from loadtest.config import LoadTestConfig
from loadtest.run import arun_sweep, build_workload, load_result, write_result
from loadtest.stats import SLO
from tests.loadtest.fake_server import FakeServer


def config(server: FakeServer, **kw: object) -> LoadTestConfig:
    args: dict[str, object] = {
        "base_url": server.base_url,
        "num_requests": 24,
        "prompt_len": "uniform:4:12",
        "output_len": "uniform:2:12",
        "warmup_requests": 0,
        "progress": False,
        "duration_limit_s": 20.0,
    }
    args.update(kw)
    return LoadTestConfig(**args)  # type: ignore[arg-type]


async def test_closed_loop_sweep(fake_server: Callable[..., FakeServer]) -> None:
    # A 10 ms step keeps the throughput ratio below about the step time, not about the
    # client's and server's own overheads, which a busy 2-core CI machine can stretch past
    # a 2 ms step (seen there: c=4 at 0.54x of c=1).
    server = fake_server(step_s=0.01, max_num_seqs=64)
    result = await arun_sweep(config(server, concurrencies=(1, 4)))
    assert result.model == "fake-model"  # discovered from /v1/models
    assert [p.point.label for p in result.points] == ["concurrency=1", "concurrency=4"]
    # Server-side: never more than 4 requests at once.
    assert server.state.max_in_flight == 4
    for point, conc in zip(result.points, (1, 4), strict=True):
        s = point.summary
        assert s.num_requests == 24 and s.num_completed == 24 and s.num_errors == 0
        assert s.max_concurrency == conc
        assert all(r.output_tokens == r.max_tokens for r in point.records)  # ignore_eos
        assert s.output_throughput_tok_s > 0 and s.ttft_p50_s is not None
        assert s.tpot_p50_s is not None and s.itl_p99_s is not None
    # Both points sent the same workload.
    first = [(r.index, r.max_tokens) for r in result.points[0].records]
    assert first == [(r.index, r.max_tokens) for r in result.points[1].records]
    # More concurrency, more throughput on a server that batches.
    c1, c4 = (p.summary.output_throughput_tok_s for p in result.points)
    assert c4 > 1.5 * c1
    # Warm-up is off, so the server saw exactly the measured requests.
    assert len(server.state.bodies) == 48
    # ... and no prompt twice: a prefix cache would answer a later point's repeats without
    # their prefills.
    prompts = [body["prompt"] for body in server.state.bodies]
    assert len(set(prompts)) == 48


async def test_open_loop_rate(fake_server: Callable[..., FakeServer]) -> None:
    server = fake_server(step_s=0.002)
    result = await arun_sweep(config(server, request_rates=(100.0,), num_requests=30, seed=3))
    (point,) = result.points
    assert point.point.kind == "rate" and point.summary.num_completed == 30
    starts = sorted(r.start_s for r in point.records)
    # 30 Poisson arrivals at 100/s span ~0.29 s; allow wide slack for a loaded machine.
    assert 0.1 < starts[-1] - starts[0] < 1.0


async def test_errors_tokenize_metrics_and_json(
    fake_server: Callable[..., FakeServer], tmp_path: Path
) -> None:
    server = fake_server(fail_every=5, tokens_per_word=2.0)
    cfg = config(server, concurrencies=(2,), num_requests=20, warmup_requests=1, slo=SLO(5, 1))
    result = await arun_sweep(cfg)
    assert result.tokens_per_word == pytest.approx(2.0)  # slope of /tokenize, BOS removed
    assert result.tokens_per_word_source == "tokenize"
    (point,) = result.points
    s = point.summary
    # The warm-up request was body #1; every 5th body fails, so 4 of the 20 measured ones.
    assert s.num_errors == 4 and s.error_rate == pytest.approx(0.2)
    assert s.goodput_fraction == pytest.approx(0.8)
    assert all("HTTP 400" in (r.error or "") for r in point.records if not r.ok)
    # Prompts were sized with 2 tokens per word: the server got exactly the workload's prompts.
    specs = build_workload(cfg, 2.0)
    assert {b["prompt"] for b in server.state.bodies[1:]} == {s.prompt for s in specs}
    assert all(len(s.prompt.split()) == max(1, round(s.prompt_len / 2)) for s in specs)
    assert result.metrics_before is not None
    assert result.metrics_before["fake_finished_total"] == 1.0  # after the warm-up
    assert point.server_metrics_after is not None
    assert point.server_metrics_after['fake_latency_bucket{le="+Inf",model="a b"}'] == 17.0

    obj = result.to_json()
    path = write_result(obj, tmp_path / "sub" / "r.json")
    loaded = load_result(path)
    assert loaded == json.loads(json.dumps(obj))
    assert loaded["schema_version"] == 1 and loaded["kind"] == "sweep"
    assert loaded["config"]["concurrencies"] == [2] and loaded["config"]["api_key_set"] is False
    summary = loaded["points"][0]["summary"]
    for key in (
        "ttft_p50_s",
        "tpot_p50_s",
        "itl_p99_s",
        "e2e_p90_s",
        "output_throughput_tok_s",
        "goodput_req_s",
        "request_throughput_req_s",
        "total_token_throughput_tok_s",
    ):
        assert key in summary
    req = loaded["points"][0]["requests"][0]
    assert set(req) >= {
        "index",
        "start_s",
        "ttft_s",
        "e2e_s",
        "chunk_times_s",
        "output_tokens",
        "error",
        "cancelled",
        "status_code",
    }


async def test_duration_limit_cancels_stragglers(fake_server: Callable[..., FakeServer]) -> None:
    # One slow request in flight when the limit hits; the drain timeout then cancels it.
    server = fake_server(step_s=0.05)
    cfg = config(
        server,
        concurrencies=(1,),
        num_requests=5,
        output_len="fixed:200",
        duration_limit_s=0.3,
        drain_timeout_s=0.2,
    )
    result = await arun_sweep(cfg)
    (point,) = result.points
    assert point.summary.num_requests == 1 and point.summary.num_cancelled == 1
    (r,) = point.records
    assert r.cancel_reason == "time_limit" and 0 < len(r.chunk_times_s) < 200
    assert point.summary.duration_s < 2.0


async def test_cancel_fraction_and_trace(
    fake_server: Callable[..., FakeServer], tmp_path: Path
) -> None:
    server = fake_server(step_s=0.002)
    result = await arun_sweep(
        config(
            server, concurrencies=(4,), num_requests=40, output_len="fixed:30", cancel_fraction=0.5
        )
    )
    s = result.points[0].summary
    assert 0 < s.num_cancelled < 40 and s.num_completed == 40 - s.num_cancelled
    assert s.goodput_fraction == 1.0  # planned hang-ups are not misses

    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps({"arrival_s": 0.1 * i, "prompt_len": 5, "max_tokens": 3}) for i in range(5)
        )
    )
    result = await arun_sweep(config(server, trace_path=str(trace)))
    (point,) = result.points
    assert point.point.kind == "trace" and point.summary.num_completed == 5
    starts = sorted(r.start_s for r in point.records)
    assert starts[-1] - starts[0] == pytest.approx(0.4, abs=0.1)


async def test_metrics_scraped_during_a_point(fake_server: Callable[..., FakeServer]) -> None:
    server = fake_server(step_s=0.01)
    fast = config(server, concurrencies=(1,), num_requests=4, metrics_interval_s=0.05)
    (point,) = (await arun_sweep(fast)).points
    # 4 requests of ~0.1 s or more each: several scrapes, each a full parse of /metrics.
    assert len(point.server_metrics_during) >= 3
    assert all("fake_finished_total" in m for m in point.server_metrics_during)
    assert "server_metrics_during" not in point.to_json()

    off = config(server, concurrencies=(1,), num_requests=2, metrics_interval_s=0)
    (point,) = (await arun_sweep(off)).points
    assert point.server_metrics_during == []
