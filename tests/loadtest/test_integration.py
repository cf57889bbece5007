"""A short sweep against the real pagedserve server (subprocess, embedded default model).

This is the check that the load generator and the server agree on the wire: SSE framing,
usage counts, ignore_eos, /tokenize calibration, and (when the server exposes it) /metrics.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.config import LoadTestConfig
from loadtest.launcher import HOST, ServerProcess, build_command, free_port
from loadtest.run import run_sweep

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 300  # the first start converts the default model's GGUF


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    port = free_port()
    argv = build_command(
        "{python} -m server --host {host} --port {port} --max-num-seqs 4 --max-model-len 256 "
        "--num-kv-blocks 64 --stats-log-interval 0 --device cpu --dtype float32",
        python=sys.executable, host=HOST, port=port,
    )  # fmt: skip
    log = Path(tmp_path_factory.mktemp("pagedserve")) / "server.log"
    with ServerProcess(argv, port, log) as process:
        process.wait_healthy(STARTUP_TIMEOUT_S)
        yield process


def test_sweep_against_pagedserve(server: ServerProcess) -> None:
    config = LoadTestConfig(
        base_url=server.base_url,
        concurrencies=(1, 4),
        num_requests=6,
        prompt_len="fixed:24",
        output_len="uniform:2:8",
        seed=0,
        warmup_requests=1,
        duration_limit_s=120.0,
        progress=False,
    )
    result = run_sweep(config)
    assert result.tokens_per_word_source == "tokenize"
    for point in result.points:
        s = point.summary
        assert s.num_completed == 6 and s.num_errors == 0, [r.error for r in point.records]
        for r in point.records:
            # ignore_eos honoured, usage reported, and the calibrated prompt is ~24 tokens.
            assert r.output_tokens == r.max_tokens and r.output_tokens_source == "usage"
            assert r.prompt_tokens is not None and abs(r.prompt_tokens - 24) <= 2
            assert r.finish_reason == "length" and len(r.chunk_times_s) >= 1
            assert r.ttft_s is not None and r.e2e_s is not None and r.ttft_s <= r.e2e_s
        assert s.ttft_p50_s is not None and s.tpot_p50_s is not None
    assert result.points[1].summary.max_concurrency == 4
