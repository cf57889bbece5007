"""Latency targets in the plan (planner/targets.py): the largest concurrency that keeps
them, by bisection over the steady-state step, capped by memory; and through the CLI, with
and without a measurement."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from planner.cli import main
from planner.report import render_targets_held, render_targets_measured
from planner.targets import (
    Targets,
    largest_concurrency_held,
    measured_against,
    plan_targets,
    steady_state,
)
from tests.planner.test_measured import _loadtest_result


def step_time(b: int, prefill: float) -> float:
    """10 ms + 2 ms a decode + 0.5 ms a prompt token."""
    return 0.010 + 0.002 * b + 0.0005 * prefill


def test_the_largest_concurrency_that_keeps_the_targets() -> None:
    # P = 128, O = 64: 2 prompt tokens a step per request, so t(b) = 10 ms + 3 ms x b.
    result = plan_targets(step_time, Targets(itl_s=0.400), 128, 64, requests_fit=0)
    assert result["max_concurrency"] == 130 and result["limited_by"] == "targets"
    at = result["at_max"]
    assert at["step_time_s"] == pytest.approx(0.400) and at["prefill_tokens_per_step"] == 260
    assert steady_state(step_time, 131, 128, 64)["step_time_s"] > 0.400
    # A TTFT target: a new prompt gets what the 400 ms leave beside the decodes, the whole
    # 128 tokens up to b = 163, in one step of 10 + 2b + 64 ms: 100 ms holds up to b = 13.
    ttft = plan_targets(step_time, Targets(itl_s=0.4, ttft_s=0.100), 128, 64, requests_fit=0)
    assert ttft["max_concurrency"] == 13
    assert ttft["at_max"]["ttft_s"] == pytest.approx(0.100)
    # Without room for the whole prompt it is prefilled over several steps: at b = 20 an
    # 80 ms budget leaves 60 tokens a step (10 + 40 + 30 ms), so 128 tokens take 3 steps.
    late = steady_state(step_time, 20, 128, 64, budget_s=0.080)
    assert late["step_time_s"] == pytest.approx(0.070)  # 40 steady prefill tokens
    assert late["ttft_s"] == pytest.approx(math.ceil(128 / 60) * 0.080)


def test_the_ratio_target_bounds_the_step_by_its_decodes_alone() -> None:
    # s = 2b prompt tokens a step: t(b, 2b) = 10 + 3b ms against the decodes' 10 + 2b ms, a
    # ratio that grows with b (towards 1.5x). 1.3x holds up to b = 7 (31 <= 31.2 ms) and
    # misses at 8 (34 > 33.8 ms).
    result = plan_targets(step_time, Targets(itl_ratio=1.3), 128, 64, requests_fit=0)
    assert result["max_concurrency"] == 7 and result["limited_by"] == "targets"
    at = result["at_max"]
    assert at["step_time_s"] == pytest.approx(0.031)
    assert at["decode_step_s"] == pytest.approx(0.024)
    # A new prompt gets what 1.3 x 24 ms leaves beside the 7 decodes: 14 tokens a step
    # (24 + 7 = 31 ms), so 128 tokens take 10 steps.
    assert at["ttft_s"] == pytest.approx(10 * 0.031)
    # With an ITL target too, the step budget is the lower of the two.
    both = plan_targets(step_time, Targets(itl_s=0.028, itl_ratio=1.3), 128, 64, 0)
    assert both["max_concurrency"] == 6  # 10 + 3 x 6 = 28 ms
    assert both["at_max"]["ttft_s"] == pytest.approx(math.ceil(128 / 12) * 0.028)


def test_the_ratio_target_is_measured_as_the_itl_p99_over_its_p50() -> None:
    targets = Targets(itl_ratio=2.0)
    steady = measured_against(targets, 0.04, 0.5, 8, itl_p99_s=0.06, itl_p50_s=0.04)
    assert steady["held"] == {"itl_ratio": True} and steady["itl_ratio"] == pytest.approx(1.5)
    stalled = measured_against(targets, 0.04, 0.5, 8, itl_p99_s=0.3, itl_p50_s=0.04)
    assert stalled["held"] == {"itl_ratio": False}
    unknown = measured_against(targets, 0.04, 0.5, 8, itl_p99_s=0.3)
    assert unknown["held"] == {"itl_ratio": None} and unknown["itl_ratio"] is None
    assert "ITL ratio missed (ITL p99 / p50 7.50x, TPOT" in render_targets_measured(stalled)
    assert "ITL ratio no figure" in render_targets_measured(unknown)
    assert "no ITL p99 and p50 in the measurement" in render_targets_measured(unknown)


def test_the_ratio_target_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", "llama-3-8b", "--device", "h100-sxm", "--prompt-tokens", "128",
            "--output-tokens", "128", "--target-itl-ratio", "2"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    targets = json.loads(capsys.readouterr().out)["targets"]
    at = targets["at_max"]
    assert targets["targets"]["itl_ratio"] == 2.0 and targets["max_concurrency"] > 1
    assert at["step_time_s"] <= 2.0 * at["decode_step_s"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "latency targets (ITL ratio 2x)" in text
    assert "the same decodes alone" in text and "(target 2x)" in text
    # Measured: ITL p99 / p50 1.30x at concurrency 1, 3.33x at 4 (a stalled step).
    path = tmp_path / "result.json"
    path.write_text(json.dumps(_loadtest_result()))
    assert main([*argv, "--measured", str(path)]) == 0
    text = capsys.readouterr().out
    assert "at the measured concurrency 1: ITL ratio held (ITL p99 / p50 1.30x" in text
    assert "at the measured concurrency 4: ITL ratio missed (ITL p99 / p50 3.33x" in text
    assert "the largest concurrency that kept every target is 1" in text


def test_memory_caps_it_and_an_impossible_target_gives_none() -> None:
    capped = plan_targets(step_time, Targets(tpot_s=0.4), 128, 64, requests_fit=12)
    assert capped["max_concurrency"] == 12 and capped["limited_by"] == "memory"
    none = plan_targets(step_time, Targets(itl_s=0.005), 128, 64, requests_fit=0)
    assert none["max_concurrency"] == 0 and none["at_max"] is None


def test_targets_in_the_plan_and_beside_a_measurement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", "llama-3-8b", "--device", "a10", "--prompt-tokens", "128",
            "--output-tokens", "64", "--target-itl-ms", "60",
            "--target-ttft-ms", "500"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    targets = data["targets"]
    best = targets["max_concurrency"]
    assert best > 1 and targets["targets"] == {
        "itl_s": 0.06,
        "tpot_s": None,
        "ttft_s": 0.5,
        "itl_ratio": None,
    }
    assert targets["at_max"]["step_time_s"] <= 0.06 and targets["at_max"]["ttft_s"] <= 0.5
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "latency targets (ITL 60.00 ms, TTFT 500.00 ms)" in text
    assert f"largest concurrency              {best:,}" in text

    path = tmp_path / "result.json"
    path.write_text(json.dumps(_loadtest_result()))
    assert main([*argv, "--measured", str(path), "--point", "concurrency=4", "--json"]) == 0
    (comparison,) = json.loads(capsys.readouterr().out)["comparisons"]
    check = comparison["latency_targets"]
    assert check["concurrency"] == 4 and set(check["held"]) == {"itl", "ttft"}
    # The ITL target is checked against the ITL p99 (120 ms), not the TPOT median (40 ms).
    assert check["itl_from"] == "itl_p99" and check["itl_p99_s"] == 0.12
    assert check["held"] == {"itl": False, "ttft": True}
    assert main([*argv, "--measured", str(path), "--point", "concurrency=4"]) == 0
    text = capsys.readouterr().out
    assert "latency targets at the measured concurrency 4: ITL missed, TTFT held" in text
    assert "(ITL p99 120.00 ms, TPOT 40.00 ms, TTFT 250.00 ms)" in text


def test_the_itl_target_reads_the_itl_p99_and_falls_back_to_tpot_saying_so() -> None:
    targets = Targets(itl_s=0.1, tpot_s=0.05, ttft_s=1.0)
    stalled = measured_against(targets, 0.04, 0.5, 8, itl_p99_s=0.3)
    assert stalled["held"] == {"itl": False, "tpot": True, "ttft": True}
    assert stalled["itl_from"] == "itl_p99"
    no_itl = measured_against(targets, 0.04, 0.5, 8)
    assert no_itl["held"] == {"itl": True, "tpot": True, "ttft": True}
    assert no_itl["itl_from"] == "tpot" and no_itl["itl_p99_s"] is None
    assert "the TPOT stands for the ITL" in render_targets_measured(no_itl)
    assert "(ITL p99" not in render_targets_measured(no_itl)
    assert "ITL p99 300.00 ms" in render_targets_measured(stalled)


def test_the_largest_measured_concurrency_that_kept_every_target() -> None:
    targets = Targets(itl_s=0.1, ttft_s=1.0)
    checks = [
        measured_against(targets, 0.02, 0.1, 1, itl_p99_s=0.03),
        measured_against(targets, 0.03, 0.2, 4, itl_p99_s=0.08),
        measured_against(targets, 0.04, 0.4, 16, itl_p99_s=0.25),  # a stall misses ITL
        measured_against(targets, 0.05, None, 32, itl_p99_s=0.05),  # no TTFT: not known
    ]
    assert largest_concurrency_held(checks) == {"max_concurrency": 4, "points": 4}
    assert largest_concurrency_held(checks[2:])["max_concurrency"] is None
    assert render_targets_held(largest_concurrency_held(checks)) == (
        "latency targets, measured: the largest concurrency that kept every target is 4 "
        "(4 measured points)"
    )


def test_the_measured_sweep_names_its_largest_concurrency_within_the_targets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "result.json"
    path.write_text(json.dumps(_loadtest_result()))
    argv = ["--model", "llama-3-8b", "--device", "a10", "--target-itl-ms", "100",
            "--measured", str(path)]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # ITL p99 35 ms at concurrency 1, 120 ms at concurrency 4.
    assert data["latency_targets_measured"] == {"max_concurrency": 1, "points": 2}
    assert main(argv) == 0
    assert "the largest concurrency that kept every target is 1 (2 measured points)" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "flag,value,says",
    [
        *[("--target-tpot-ms", v, "must be a positive number") for v in ("0", "-5", "nan")],
        *[("--target-itl-ratio", v, "must be a number above 1") for v in ("1", "0.5", "inf")],
    ],
)
def test_a_target_out_of_range_is_one_error_line(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "a10", flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} {says}" in err[0], err
