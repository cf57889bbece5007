"""Prometheus metrics through the app (FakeEngine): counts agree with the traffic sent, every
way a request can end is counted once, HTTP statuses, MBU/MFU arithmetic, peak resolution.
The real server + real Prometheus test lives in tests/deploy/test_prometheus.py."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

import planner.cpu
from engine.outputs import REPLAYS, STEP_PHASES, StepStats
from server.config import ServingConfig
from server.metrics import ServerMetrics, config_info, token_buckets
from server.peaks import Peaks, resolve_peaks
from server.stats_log import overhead_summary
from server.timings import RequestTimings
from tests.server.server_fakes import FakeEngine
from tests.server.test_streaming import call_asgi

M = {"model_name": "fake-model"}


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, frozenset({**M, **labels}.items()))]


async def scrape(s) -> str:
    r = await s.http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return r.text


async def test_counters_and_histograms_match_the_requests_sent(serve) -> None:
    s = await serve()
    r = await s.http.post(
        "/v1/completions", json={"prompt": ["a b", "one"], "n": 2, "max_tokens": 3}
    )
    usage = r.json()["usage"]
    await s.wait_idle()
    text = await scrape(s)
    assert value(text, "pagedserve_requests_finished_total", finished_reason="length") == 4
    assert value(text, "pagedserve_requests_finished_total", finished_reason="stop") == 0
    assert value(text, "pagedserve_generation_tokens_total") == usage["completion_tokens"] == 12
    # Prompt tokens count once per choice (engine request); usage counts once per prompt.
    assert value(text, "pagedserve_prompt_tokens_total") == 2 * usage["prompt_tokens"]
    assert value(text, "pagedserve_time_to_first_token_seconds_count") == 4
    assert value(text, "pagedserve_inter_token_latency_seconds_count") == 4 * 2
    assert value(text, "pagedserve_time_per_output_token_seconds_count") == 4
    assert value(text, "pagedserve_e2e_request_latency_seconds_count") == 4
    assert value(text, "pagedserve_request_generation_tokens_sum") == 12
    assert value(text, "pagedserve_request_generation_tokens_bucket", le="2.0") == 0
    assert value(text, "pagedserve_request_generation_tokens_bucket", le="5.0") == 4
    assert value(text, "pagedserve_step_tokens_count") >= 3  # the step hook is wired
    assert value(text, "pagedserve_kv_blocks_total") == 64
    assert (
        value(text, "pagedserve_http_requests_total", handler="/v1/completions", status="200") == 1
    )
    # The batching mode and what shapes a step, as an info metric (default config here).
    assert value(text, "pagedserve_config_info", **config_info(ServingConfig())) == 1
    assert config_info(ServingConfig())["batching"] == "continuous"


async def test_stop_and_client_errors_are_counted(serve) -> None:
    s = await serve(FakeEngine(eos_after=2))
    ok = await s.http.post("/v1/completions", json={"prompt": "a", "max_tokens": 10})
    assert ok.json()["choices"][0]["finish_reason"] == "stop"
    bad = await s.http.post("/v1/completions", json={"prompt": "a", "max_tokens": -1})
    assert bad.status_code == 400
    assert (await s.http.get("/no/such/path")).status_code == 404
    await s.wait_idle()
    text = await scrape(s)
    assert value(text, "pagedserve_requests_finished_total", finished_reason="stop") == 1
    assert (
        value(text, "pagedserve_http_requests_total", handler="/v1/completions", status="400") == 1
    )
    assert value(text, "pagedserve_http_requests_total", handler="other", status="404") == 1


async def test_engine_failure_counts_as_error(serve) -> None:
    engine = FakeEngine(step_delay_s=0.01)
    s = await serve(engine)

    def fail_on_second(e: FakeEngine) -> None:
        if e.num_steps == 2:
            e.fail_next_step = RuntimeError("kaboom")
            e.before_step = None

    engine.before_step = fail_on_second
    r = await s.http.post("/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 50})
    assert r.status_code == 500
    await s.wait_idle()
    text = await scrape(s)
    assert value(text, "pagedserve_requests_finished_total", finished_reason="error") == 2
    assert (
        value(text, "pagedserve_http_requests_total", handler="/v1/completions", status="500") == 1
    )
    # The successes' series exists from the start (rate() needs a sample before the burst).
    assert (
        value(text, "pagedserve_http_requests_total", handler="/v1/completions", status="200") == 0
    )
    # Failed requests stay out of the latency histograms.
    assert value(text, "pagedserve_e2e_request_latency_seconds_count") == 0


async def test_client_disconnect_counts_as_abort(serve) -> None:
    engine = FakeEngine(step_delay_s=0.01, max_model_len=100_000, num_blocks=100_000)
    s = await serve(engine)
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "stream": True}
    await call_asgi(s.app, "/v1/chat/completions", body, disconnect_after_s=0.2)
    await s.wait_idle()
    text = await scrape(s)
    assert value(text, "pagedserve_requests_finished_total", finished_reason="abort") == 3
    # The tokens delivered before the disconnect were counted as they arrived.
    assert value(text, "pagedserve_generation_tokens_total") >= 3
    assert_idle_gauges(text)


def assert_idle_gauges(text: str) -> None:
    """The load gauges of an engine that aborted its last requests: no step reported it, and
    routers reading them must not see the shed load forever."""
    assert value(text, "pagedserve_num_requests_running") == 0
    assert value(text, "pagedserve_num_requests_waiting") == 0
    assert value(text, "pagedserve_kv_blocks_used") == 0
    assert value(text, "pagedserve_kv_cache_usage_ratio") == 0
    assert value(text, "vllm:num_requests_running") == 0
    assert value(text, "vllm:kv_cache_usage_perc") == 0


# Prometheus 2.x's default scrape Accept header (OpenMetrics first, names escaped).
PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
# Prometheus 3's (UTF-8 names, no escaping).
PROMETHEUS_3_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


def parse_scrape(content_type: str, body: str) -> dict[str, list[Any]]:
    """Each family's samples, parsed by the parser of the format the server said it sent."""
    if content_type.startswith("application/openmetrics-text"):
        families = openmetrics_families(body)
    else:
        assert content_type.startswith("text/plain"), content_type
        families = text_string_to_metric_families(body)
    return {family.name: list(family.samples) for family in families}


@pytest.mark.parametrize(
    "accept",
    [
        None,
        "text/plain",
        "text/plain;version=0.0.4",
        "*/*",
        pytest.param(PROMETHEUS_2_ACCEPT, id="prometheus-2"),
        pytest.param(PROMETHEUS_3_ACCEPT, id="prometheus-3"),
        "application/openmetrics-text",
        "application/openmetrics-text;version=1.0.0;escaping=underscores",
        "application/openmetrics-text;version=1.0.0;escaping=dots",
        "application/openmetrics-text;version=1.0.0;escaping=values",
    ],
)
async def test_every_scraper_gets_the_vllm_names_intact(serve, accept: str | None) -> None:
    """Whatever format the Accept header negotiates, the body parsed with that format's
    parser has the ``vllm:*`` families with their samples, under their colon names (a
    Prometheus 2.x scrape once got ``vllm_*`` samples under ``vllm:*`` TYPE lines)."""
    s = await serve()
    r = await s.http.get("/metrics", headers={"accept": accept} if accept else {})
    assert r.status_code == 200
    content_type = r.headers["content-type"]
    families = parse_scrape(content_type, r.text)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        (sample,) = families[name]
        assert sample.name == name and sample.labels == M and sample.value == 0, sample
    assert not any(name.startswith("vllm_") for name in families), sorted(families)
    assert "pagedserve_num_requests_waiting" in families


async def test_prometheus_2_gets_the_text_format(serve) -> None:
    s = await serve()
    r = await s.http.get("/metrics", headers={"accept": PROMETHEUS_2_ACCEPT})
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "\nvllm:num_requests_waiting{" in r.text and "vllm_num_requests" not in r.text


async def test_openmetrics_is_negotiated_without_name_escaping(serve) -> None:
    s = await serve()
    r = await s.http.get("/metrics", headers={"accept": PROMETHEUS_3_ACCEPT})
    content_type = r.headers["content-type"]
    assert content_type.startswith("application/openmetrics-text"), content_type
    assert "escaping=allow-utf-8" in content_type
    assert r.text.rstrip().endswith("# EOF")
    assert "\nvllm:num_requests_waiting{" in r.text and "vllm_num_requests" not in r.text


def test_request_timings() -> None:
    t = RequestTimings(arrival_time=10.0, num_prompt_tokens=5, scheduled_time=10.1)
    t.on_tokens(1, 10.5)
    t.on_tokens(2, 10.7)
    t.on_tokens(1, 11.0)
    t.on_finish("length", 11.0)
    assert t.ttft_s == 0.5 and t.e2e_s == 1.0 and t.num_output_tokens == 4
    assert t.queue_s == pytest.approx(0.1) and t.prefill_s == pytest.approx(0.4)
    assert t.decode_s == pytest.approx(0.5)
    assert t.last_inter_token_latency_s == pytest.approx(0.3)
    assert t.tpot_s == pytest.approx(0.5 / 3)
    single = RequestTimings(arrival_time=0.0)
    single.on_tokens(1, 1.0)
    single.on_finish("stop", 1.0)
    assert single.tpot_s is None and single.last_inter_token_latency_s is None


def _step(**overrides: float) -> StepStats:
    fields = dict(step_time_s=0.1, num_running=1, num_waiting=0, num_prefill_tokens=0,
                  num_decode_tokens=1, num_preemptions=0, num_kv_blocks_used=2,
                  num_kv_blocks_total=8, weight_bytes=10**9, kv_bytes_read=0,
                  kv_bytes_written=0, flops=10**11)  # fmt: skip
    fields.update(overrides)
    return StepStats(**fields)  # type: ignore[arg-type]


def test_mbu_and_mfu_per_step_and_smoothed() -> None:
    peaks = Peaks("test", 20e9, 1e13, "flag", "flag")
    metrics = ServerMetrics("m", peaks=peaks, log_interval_s=0)

    def get(name: str) -> float:
        v = metrics.registry.get_sample_value(f"pagedserve_{name}", {"model_name": "m"})
        assert v is not None
        return v

    # 1 GB in 0.1 s = 10 GB/s of 20 GB/s; 1e11 FLOPs in 0.1 s = 1e12 of 1e13 FLOP/s.
    metrics.record_step(_step())
    assert get("mbu") == pytest.approx(0.5)
    assert get("mfu") == pytest.approx(0.1)
    assert get("achieved_bandwidth_bytes_per_second") == pytest.approx(10e9)
    assert get("peak_bandwidth_bytes_per_second") == 20e9
    # A step that moves 3x the bytes in the same time: last-step MBU jumps, the smoothed one
    # is the ratio of decayed sums, between the two.
    metrics.record_step(_step(weight_bytes=2 * 10**9, kv_bytes_read=10**9))
    assert get("mbu") == pytest.approx(1.5)
    decay = math.exp(-0.1 / 10.0)
    expected = (1e9 * decay + 3e9) / (0.1 * decay + 0.1) / 20e9
    assert get("mbu_smoothed") == pytest.approx(expected)
    assert get("kv_bytes_read_total") == 1e9
    assert get("step_duration_seconds_sum") == pytest.approx(0.2)


def test_no_peaks_no_utilization_gauges() -> None:
    metrics = ServerMetrics("m", log_interval_s=0)
    metrics.record_step(_step())
    assert metrics.registry.get_sample_value("pagedserve_mbu", {"model_name": "m"}) is None
    assert metrics.registry.get_sample_value(
        "pagedserve_achieved_bandwidth_bytes_per_second", {"model_name": "m"}
    ) == pytest.approx(10e9)


def test_summary_log_line(caplog) -> None:
    metrics = ServerMetrics("m", peaks=Peaks("t", 20e9, None, "flag", "unknown"),
                            log_interval_s=1e-9)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="server.metrics"):
        metrics.record_step(_step(num_running=2, num_waiting=1, num_kv_blocks_used=3,
                                  num_kv_blocks_total=12))  # fmt: skip
    assert "running: 2, waiting: 1, KV usage: 25.0% (3/12 blocks)" in caplog.text
    assert "MBU (last step): 50.0%" in caplog.text


def test_step_phases_counted_and_logged(caplog) -> None:
    metrics = ServerMetrics("m", log_interval_s=1e-9)
    phases = {"schedule": 0.001, "prepare": 0.002, "forward": 0.09, "sample": 0.003,
              "update": 0.002, "between_steps": 0.002}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="server.metrics"):
        metrics.record_step(_step(phase_s=phases))
        metrics.record_step(_step(phase_s=phases))

    def phase(name: str) -> float | None:
        return metrics.registry.get_sample_value(
            "pagedserve_step_phase_seconds_total", {"model_name": "m", "phase": name}
        )

    assert phase("forward") == pytest.approx(0.18)
    assert phase("between_steps") == pytest.approx(0.004)
    # 10 ms of every 100 ms is outside the model.
    assert (
        "step time outside the model: 10.0% (schedule 1.0%, prepare 2.0%, sample 3.0%, "
        "update 2.0%, between steps 2.0%)" in caplog.text
    )


def test_steps_counted_by_how_their_forward_ran() -> None:
    """One series per way (zero before the first step); a step that does not say (a step
    re-run in parts after a failure) counts in none."""
    metrics = ServerMetrics("m", log_interval_s=0)

    def steps(replay: str) -> float | None:
        return metrics.registry.get_sample_value(
            "pagedserve_steps_by_replay_total", {"model_name": "m", "replay": replay}
        )

    assert all(steps(way) == 0.0 for way in REPLAYS)
    for way in ("decode_graph", "decode_graph", "whole_graph", "eager", ""):
        metrics.record_step(_step(replay=way))  # type: ignore[arg-type]
    assert [steps(way) for way in REPLAYS] == [2.0, 1.0, 0.0, 1.0]


def test_step_phases_exist_before_the_first_step() -> None:
    metrics = ServerMetrics("m", log_interval_s=0)
    for name in STEP_PHASES:
        assert (
            metrics.registry.get_sample_value(
                "pagedserve_step_phase_seconds_total", {"model_name": "m", "phase": name}
            )
            == 0.0
        )
    assert overhead_summary({}) == "n/a"


def test_token_buckets() -> None:
    assert token_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)


def test_peak_flags_win_and_need_no_measurement(monkeypatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("must not measure when both flags are given")

    monkeypatch.setattr(planner.cpu, "measure_cpu_peaks", boom)
    config = ServingConfig.from_cli(["--peak-bandwidth-gbps", "12.5", "--peak-tflops", "0.2"])
    peaks = resolve_peaks(
        "cpu",
        "float32",
        bandwidth_gbps=config.server.peak_bandwidth_gbps,
        tflops=config.server.peak_tflops,
    )
    assert (peaks.bandwidth, peaks.flops) == (12.5e9, 0.2e12)
    assert peaks.bandwidth_source == peaks.flops_source == "flag"


def test_cpu_peaks_come_from_the_cached_measurement(monkeypatch) -> None:
    measured = planner.cpu.CpuPeaks(8e9, {"fp32": 1e11}, 8e9, 6e9)
    monkeypatch.setattr(planner.cpu, "measure_cpu_peaks", lambda dtypes: measured)
    peaks = resolve_peaks("cpu", "float32", tflops=3.0)
    assert (peaks.bandwidth, peaks.bandwidth_source) == (8e9, "measured")
    assert (peaks.flops, peaks.flops_source) == (3e12, "flag")


def test_gpu_peaks_come_from_the_device_table(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    peaks = resolve_peaks("cuda:0", "bfloat16")
    assert peaks.device == "h100-sxm" and peaks.bandwidth_source == "table"
    assert (peaks.bandwidth, peaks.flops) == (3350e9, 989.4e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some Future GPU")
    unknown = resolve_peaks("cuda:0", "bfloat16")
    assert unknown.bandwidth is None and unknown.device == "Some Future GPU"


def test_peak_flags_are_validated() -> None:
    with pytest.raises(SystemExit):
        ServingConfig.from_cli(["--peak-bandwidth-gbps", "-1"])


async def test_deadline_counts_as_abort(serve) -> None:
    engine = FakeEngine(step_delay_s=0.01, max_model_len=100_000, num_blocks=100_000)
    s = await serve(engine, request_timeout_s=0.2)
    r = await s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50_000})
    assert r.status_code == 504
    await s.wait_idle()
    text = await scrape(s)
    assert value(text, "pagedserve_requests_finished_total", finished_reason="abort") == 1
    assert (
        value(text, "pagedserve_http_requests_total", handler="/v1/completions", status="504") == 1
    )
    assert_idle_gauges(text)


def test_series_with_a_second_label_bind_on_first_use() -> None:
    metrics = ServerMetrics("m", log_interval_s=0)
    metrics.record_step(_step(phase_s={"forward": 0.5, "a_new_phase": 0.25}))
    metrics.record_step(_step(phase_s={"forward": 0.5, "a_new_phase": 0.25}))
    metrics.record_http("/v1/chat/completions", 429)
    get = metrics.registry.get_sample_value
    phase = "pagedserve_step_phase_seconds_total"
    assert get(phase, {"model_name": "m", "phase": "forward"}) == 1.0
    assert get(phase, {"model_name": "m", "phase": "a_new_phase"}) == pytest.approx(0.5)
    labels = {"model_name": "m", "handler": "/v1/chat/completions", "status": "429"}
    assert get("pagedserve_http_requests_total", labels) == 1.0
    # Known values exist from the start, at zero.
    abort = {"model_name": "m", "finished_reason": "abort"}
    assert get("pagedserve_requests_finished_total", abort) == 0.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_config_info_reports_the_dtype_the_matmuls_read(tmp_path, dtype: str) -> None:
    """A float32 checkpoint served in bfloat16 multiplies by bfloat16 weights; the label must
    not claim float32 (without GGUF blocks the matmul weights are the serving dtype's)."""
    from engine.llm_engine import LLMEngine
    from server.config import ServerConfig
    from tests.server.tiny_server import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "tiny")
    config = ServingConfig.from_cli(
        [str(model), "--dtype", dtype, "--device", "cpu", "--num-kv-blocks", "8",
         "--target-itl-ratio", "2"], {}
    )  # fmt: skip
    engine = LLMEngine(config.engine, config.kvpool, config.scheduler)
    assert engine.matmul_weights == dtype
    # Given peaks: no CPU probe in a unit test.
    given = ServingConfig(
        engine=config.engine,
        kvpool=config.kvpool,
        scheduler=config.scheduler,
        server=ServerConfig(stats_log_interval_s=0, peak_bandwidth_gbps=10, peak_tflops=1),
    )
    metrics = ServerMetrics.for_engine(given, engine)
    text = metrics.exposition(None)[0].decode()
    info = samples(text)
    labels = next(dict(k[1]) for k in info if k[0] == "pagedserve_config_info")
    assert labels["matmul_weights"] == dtype and labels["dtype"] == dtype
    assert labels["async_scheduling"] == "false"  # off on the CPU unless asked for
    # the flag, through the config
    assert [v for k, v in info.items() if k[0] == "pagedserve_target_itl_ratio"] == [2.0]


def test_cpu_peaks_are_logged_with_the_l3_size_and_a_warning_when_taken_under_load(
    monkeypatch, caplog
) -> None:
    busy = planner.cpu.CpuPeaks(
        14e9, {"fp32": 9e10}, 13.8e9, 14e9, "2026-11-26T10:00:00+00:00", True, 0.6
    )
    monkeypatch.setattr(planner.cpu, "measure_cpu_peaks", lambda dtypes: busy)
    monkeypatch.setattr(planner.cpu, "l3_cache_bytes", lambda: 300 * 2**20)
    with caplog.at_level(logging.INFO, logger="server.peaks"):
        resolve_peaks("cpu", "float32")
    text = caplog.text
    assert "read 13.8 GB/s, copy 14.0 GB/s, fp32 matmul 90 GFLOP/s" in text
    assert "L3 cache 300 MiB" in text and "MBU may exceed 1" in text
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "60%" in warnings[0].getMessage()


def test_latency_target_series_on_metrics() -> None:
    metrics = ServerMetrics(
        M["model_name"], latency_targets={"itl": 0.4, "ttft": 2.0}, target_itl_ratio=2.5
    )
    base = dict(num_kv_blocks_used=1, num_kv_blocks_total=8)
    metrics.record_step(StepStats(0.30, 8, 2, 64, 8, 0, **base, predicted_step_s=0.27,
                                  target_budget_s=0.4, target_prefill_cap=64, target_met=True))
    metrics.record_step(StepStats(0.50, 8, 2, 32, 8, 0, **base, predicted_step_s=0.30,
                                  target_budget_s=0.4, target_prefill_cap=32, target_met=False,
                                  target_ttft_boost=True, target_conflict=True))
    metrics.record_step(StepStats(0.10, 0, 1, 512, 0, 0, **base))  # no target data
    text, _ = metrics.exposition(None)
    text = text.decode()
    assert value(text, "pagedserve_target_itl_seconds") == 0.4
    assert value(text, "pagedserve_target_ttft_seconds") == 2.0
    assert value(text, "pagedserve_target_itl_ratio") == 2.5
    assert ("pagedserve_target_tpot_seconds", frozenset(M.items())) not in samples(text)
    assert value(text, "pagedserve_target_steps_total") == 2
    assert value(text, "pagedserve_target_steps_met_total") == 1
    assert value(text, "pagedserve_target_ttft_boosts_total") == 1
    assert value(text, "pagedserve_target_conflicts_total") == 1
    assert value(text, "pagedserve_target_prefill_cap_tokens_sum") == 96
    # 0.27 / 0.30 = 0.9 and 0.30 / 0.50 = 0.6: one within 20%, one not.
    assert value(text, "pagedserve_step_time_prediction_ratio_count") == 2
    assert value(text, "pagedserve_step_time_prediction_ratio_bucket", le="1.2") == 2
    assert value(text, "pagedserve_step_time_prediction_ratio_bucket", le="0.8") == 1


def test_speculative_decoding_counters_and_step_times() -> None:
    metrics = ServerMetrics("m", log_interval_s=0)

    def get(name: str) -> float | None:
        return metrics.registry.get_sample_value(f"pagedserve_{name}", {"model_name": "m"})

    metrics.record_step(_step())  # no speculation: counters stay at 0, no time observed
    assert get("spec_decode_draft_tokens_total") == 0
    assert get("spec_decode_draft_seconds_count") == 0
    metrics.record_step(_step(num_draft_tokens=8, num_accepted_tokens=5,
                              num_spec_verifications=2, spec_draft_s=0.002,
                              spec_accept_s=0.003))  # fmt: skip
    metrics.record_step(_step(num_draft_tokens=4, num_accepted_tokens=1,
                              num_spec_verifications=1, spec_draft_s=0.001,
                              spec_accept_s=0.001))  # fmt: skip
    assert get("spec_decode_draft_tokens_total") == 12
    assert get("spec_decode_accepted_tokens_total") == 6
    assert get("spec_decode_verifications_total") == 3
    assert get("spec_decode_draft_seconds_count") == 2
    assert get("spec_decode_accept_seconds_sum") == pytest.approx(0.004)
