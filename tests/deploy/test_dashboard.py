"""The committed Grafana dashboard is what deploy/grafana/dashboard.py generates, its queries
name metrics the server exports, and the provisioning files point at it. (Whether each query
returns data is tests/deploy/test_prometheus.py's job, against a real Prometheus.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.outputs import StepStats
from server.metrics import ServerMetrics
from server.peaks import Peaks

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pagedserve.json"


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def test_committed_json_is_the_generators_output() -> None:
    pytest.importorskip(
        "grafana_foundation_sdk",
        reason="pip install 'grafana-foundation-sdk==1769699998!10.1.0' (the generator's SDK)",
    )
    result = subprocess.run(
        [sys.executable, str(DEPLOY / "grafana" / "dashboard.py"), "--check"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_queries_name_only_exported_metrics() -> None:
    metrics = ServerMetrics(
        "m",
        peaks=Peaks("cpu", 1e10, 1e11, "flag", "flag"),
        latency_targets={"itl": 0.4, "tpot": 0.2, "ttft": 2.0},
    )
    # Series that appear with the first step and the first HTTP response.
    metrics.record_step(StepStats(0.1, 1, 0, 0, 1, 0, 1, 8, weight_bytes=1, flops=1))
    metrics.record_http("/health", 200)
    exported = {s.name for family in metrics.registry.collect() for s in family.samples}
    used: set[str] = set()
    for panel in _dashboard()["panels"]:
        for target in panel.get("targets") or []:
            used |= set(re.findall(r"\bpagedserve_[a-z0-9_]+", target["expr"]))
    assert used, "no pagedserve_ metric in the dashboard"
    assert used <= exported, f"not exported: {sorted(used - exported)}"


def test_panels_cover_the_issue_and_ids_are_unique() -> None:
    panels = _dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets") or [])
    for needed in (
        "time_to_first_token", "time_per_output_token", "inter_token_latency",
        "requests_finished", "generation_tokens", "mbu", "mfu", "kv_cache_usage",
        "num_requests_running", "num_requests_waiting", "preemptions", "config_info",
    ):  # fmt: skip
        assert f"pagedserve_{needed}" in exprs, needed
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(pagedserve_inter_token" in exprs


def test_provisioning_points_at_the_dashboard() -> None:
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    uids = {
        p["datasource"]["uid"] for p in _dashboard()["panels"] if p.get("datasource") is not None
    }
    assert uids == {source["uid"]}
    assert source["url"] == "http://prometheus:9090"  # the compose service
    providers = yaml.safe_load((provisioning / "dashboards" / "pagedserve.yml").read_text())
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert (
        f"./deploy/grafana/dashboards:{providers['providers'][0]['options']['path']}:ro" in mounts
    )


def test_the_mbu_panel_explains_a_reading_above_one() -> None:
    """Batch-1 MBU can read above 100% on a CPU whose L3 holds a step's weights; the panel
    itself must say why, where the reader sees it."""
    panels = [p for p in _dashboard()["panels"] if p.get("title", "").startswith("MBU")]
    assert len(panels) == 1
    description = panels[0]["description"]
    assert "Above 100%" in description and "L3" in description and "DRAM" in description
