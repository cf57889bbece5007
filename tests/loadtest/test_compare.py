"""`python -m loadtest compare` starting the fake server as a subprocess in each mode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from loadtest.cli import main
from loadtest.compare import CompareConfig, Mode

FAKE_SERVER = Path(__file__).resolve().parent / "fake_server.py"


def test_compare_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The default modes' arguments (--batching ... --batch-wait-ms ...) drive the fake server,
    # which steps every 3 ms and batches 4 sequences.
    server_cmd = (
        f"{sys.executable} {FAKE_SERVER} --host {{host}} --port {{port}} "
        "--max-num-seqs {max_num_seqs} --step-ms 3 {mode_args}"
    )
    out = tmp_path / "cmp.json"
    argv = ["compare", "--server-cmd", server_cmd, "--modes", "static,continuous",
            "--max-num-seqs", "4", "--num-requests", "24",
            "--low-load-num-requests", "6", "--prompt-len-dist", "4",
            "--output-len-dist", "exponential:10:60", "--seed", "1", "--warmup-requests", "1",
            "--startup-timeout", "30", "--duration-limit", "20", "--no-progress",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["kind"] == "compare" and result["baseline"] == "static"
    assert [m["name"] for m in result["modes"]] == ["static", "continuous"]
    assert all(m["error"] is None for m in result["modes"])
    capacity = result["capacity_req_s"]
    assert capacity and capacity > 0
    rates = {s["name"]: s["request_rate"] for s in result["scenarios"]}
    assert rates["poisson-capacity"] == pytest.approx(capacity)
    assert rates["poisson-low"] == pytest.approx(0.2 * capacity)
    rows = {(r["scenario"], r["mode"]): r for r in result["table"]}
    assert len(rows) == 6 and all(r["num_errors"] == 0 for r in rows.values())
    assert rows[("closed-c4", "static")]["throughput_vs_baseline"] == pytest.approx(1.0)
    # A fixed batch waits for its longest request; continuous refills every step.
    assert rows[("closed-c4", "continuous")]["throughput_vs_baseline"] > 1.2
    for scenario in rates:
        runs = [m["runs"][scenario] for m in result["modes"]]
        assert len({json.dumps(r["points"][0]["point"]) for r in runs}) == 1  # same load
    markdown = Path(result["markdown"]).read_text()
    assert "| closed-c4 | continuous |" in markdown and "--batching static" in markdown
    assert "continuous" in printed and "x lower" in printed
    assert result["config"]["invocation"].startswith("python -m loadtest compare")
    assert all(Path(m["log"]).exists() for m in result["modes"])


def test_baseline_must_be_a_mode() -> None:
    with pytest.raises(ValueError, match="baseline"):
        CompareConfig(modes=(Mode("a", ""),), baseline="static")
    with pytest.raises(ValueError, match="unique"):
        CompareConfig(modes=(Mode("a", ""), Mode("a", "x")), baseline="a")


def test_failing_modes_do_not_lose_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server_cmd = f"{sys.executable} {FAKE_SERVER} --port {{port}} {{mode_args}}"
    # "dynamic" is the built-in mode (its arguments are a template themselves).
    argv = ["compare", "--server-cmd", server_cmd, "--modes", "dynamic,errors,crash",
            "--baseline", "dynamic", "--batch-wait-ms", "20",
            "--mode", "errors=--fail-every 1", "--mode", "crash=--no-such-flag",
            "--num-requests", "4",
            "--low-load-num-requests", "2", "--prompt-len-dist", "4", "--output-len-dist", "4",
            "--startup-timeout", "30", "--no-progress",
            "--out", str(tmp_path / "c.json")]  # fmt: skip
    assert main(argv) == 1
    assert "failed" in capsys.readouterr().err
    result = json.loads((tmp_path / "c.json").read_text())
    modes = {m["name"]: m for m in result["modes"]}
    assert modes["dynamic"]["error"] is None and len(modes["dynamic"]["runs"]) == 3
    assert "--batching dynamic --batch-wait-ms 20" in " ".join(modes["dynamic"]["command"])
    assert "warm-up request failed" in modes["errors"]["error"]  # healthy, but every 400
    assert "exited with code 2" in modes["crash"]["error"]  # argparse rejected the flag
    assert {r["mode"] for r in result["table"]} == {"dynamic"}
    markdown = Path(result["markdown"]).read_text()
    assert "- command: `python -m loadtest compare --server-cmd" in markdown
    assert "**crash failed**" in markdown
