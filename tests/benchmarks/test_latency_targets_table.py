"""The table of ``python -m benchmarks.latency_targets``: both target forms, and the ITL p99
over each run's own p50 (issue 35's p99 / p50)."""

from __future__ import annotations

from benchmarks.latency_targets import table


def _row(itl_p50: float, itl_p99: float, tok_s: float, ttft: float) -> dict:
    return {"itl_p50_s": itl_p50, "itl_p99_s": itl_p99, "output_tok_s": tok_s,
            "ttft_p50_s": ttft, "steps_within_budget": 0.95,
            "predictions_within_20pct": 0.9}  # fmt: skip


def test_the_table_reads_each_runs_p99_over_its_p50_and_names_the_relative_target():
    results = {
        "untargeted": {"c64": _row(0.050, 0.400, 600.0, 1.0)},
        "targeted": {"c64": _row(0.060, 0.110, 540.0, 1.2)},
    }
    text = table(results, 0.100, ratio=2.0)
    lines = text.splitlines()
    assert lines[0] == "target ITL 2 x the decode step (about 100 ms)"
    none, target = lines[2].split(), lines[3].split()
    assert none[:5] == ["c64", "none", "0.400s", "4.00", "8.00"]
    assert target[:7] == ["c64", "target", "0.110s", "1.10", "1.83", "540.0", "0.90"]
    assert table(results, 0.150).splitlines()[0] == "target ITL 150 ms"
