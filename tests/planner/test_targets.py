"""Latency targets in the plan (planner/targets.py): the largest concurrency that keeps
them, by bisection over the steady-state step, capped by memory; and through the CLI, with
and without a measurement."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from planner.cli import main
from planner.targets import Targets, plan_targets, steady_state
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
    assert best > 1 and targets["targets"] == {"itl_s": 0.06, "tpot_s": None, "ttft_s": 0.5}
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
    assert check["held"]["itl"] is (check["tpot_s"] <= 0.06)
    assert main([*argv, "--measured", str(path), "--point", "concurrency=4"]) == 0
    assert "latency targets at the measured concurrency 4: ITL" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_a_target_that_is_not_positive_is_one_error_line(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "a10", "--target-tpot-ms", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--target-tpot-ms must be a positive number" in err[0], err
