"""Plots from real sweep results (skipped when matplotlib, an optional extra, is absent)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from loadtest.config import LoadTestConfig
from loadtest.plots import plot_compare, plot_sweep, tpot_values, ttft_values
from loadtest.run import arun_sweep
from tests.loadtest.fake_server import FakeServer


def test_value_extraction_skips_failed_requests() -> None:
    ok = {"error": None, "cancelled": False, "ttft_s": 0.5, "e2e_s": 1.5, "output_tokens": 11}
    bad = dict(ok, error="HTTP 500")
    cut = dict(ok, cancelled=True)
    one = dict(ok, output_tokens=1, ttft_s=0.2)
    assert ttft_values([ok, bad, cut, one]) == [0.2, 0.5]
    assert tpot_values([ok, bad, cut, one]) == pytest.approx([0.1])


async def test_plots_are_written(fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    server = fake_server()
    cfg = LoadTestConfig(base_url=server.base_url, concurrencies=(1, 2), num_requests=6,
                         prompt_len="4", output_len="uniform:2:8", warmup_requests=0,
                         progress=False)  # fmt: skip
    sweep = (await arun_sweep(cfg)).to_json()
    written = plot_sweep(sweep, tmp_path / "sweep")
    assert [p.name for p in written] == ["sweep-throughput_latency.png", "sweep-cdf.png"]
    single = dict(sweep, points=sweep["points"][:1])
    compare = {
        "modes": [
            {"name": "static", "runs": {"closed": single}},
            {"name": "continuous", "runs": {"closed": single}},
        ],
        "scenarios": [{"name": "closed"}],
    }
    written = plot_compare(compare, tmp_path / "cmp")
    assert [p.name for p in written] == ["cmp-modes.png", "cmp-ttft_cdf.png"]
    for path in written:
        assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
