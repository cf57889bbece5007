"""``pagedserve plan`` end to end: the table, --json, --measured, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cli import main
from tests.planner.conftest import FAKE_FLOPS, FAKE_READ_BW, FakeCpu
from tests.planner.test_measured import _loadtest_result, _prometheus_text


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_table_for_the_worked_example(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(
        capsys, "--model", "llama-2-7b", "--device", "a10", "--dtype", "fp16", "--context", "4096"
    )
    assert "llama-2-7b (preset) on a10" in out
    assert "208.3" in out  # ops:byte
    assert "524,288 B" in out  # KV per token
    assert "62.4 -> memory-bound" in out  # attention at N=4096
    assert "sequences of 4,096 tokens" in out
    assert "cost at $0.75/h" in out


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    out = json.loads(
        _run(
            capsys,
            "plan",
            "--model",
            "llama-3-8b",
            "--device",
            "h100-sxm",
            "--kv-dtype",
            "int8",
            "--batch",
            "8",
            "--price-per-hour",
            "4",
            "--json",
        )
    )
    assert out["kv_bytes_per_token"] == 66_560  # int8 values + a float16 scale per row
    assert out["dtypes"] == {"weights": "bf16", "kv": "int8", "compute": "bf16"}
    assert out["workload"] == {
        "prompt_tokens": 350,
        "output_tokens": 150,
        "batch": 8,
        "context": 8192,
    }
    assert out["cost"]["price_per_hour"] == 4.0
    assert out["decode"]["time_per_token_s"] > 0
    assert "comparisons" not in out


def test_default_model_on_cpu_uses_the_measured_peaks(capsys: pytest.CaptureFixture[str]) -> None:
    out = json.loads(_run(capsys, "--model", "default", "--device", "cpu", "--json"))
    assert out["model"]["name"] == "smollm2-135m"
    assert out["device"]["measured"] is True
    assert out["device"]["memory_bandwidth"] == FAKE_READ_BW
    assert out["device"]["peak_flops"] == FAKE_FLOPS
    assert out["dtypes"]["weights"] == "fp32"  # the server's CPU default
    # --matmul-weights float32: 134.5 M fp32 params = 538 MB read per token at 20 GB/s,
    # about 27 ms.
    f32 = json.loads(
        _run(capsys, "--model", "default", "--device", "cpu", "--matmul-weights", "float32",
             "--json")
    )  # fmt: skip
    assert f32["decode"]["weight_bytes_per_step"] == pytest.approx(538e6, rel=0.01)
    assert f32["decode"]["time_per_token_s"] == pytest.approx(0.0272, rel=0.03)


def test_the_default_plan_reads_what_the_default_server_reads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """By default the server multiplies batches of up to max_quant_rows() rows by the GGUF
    file's own blocks (112 MB a step for the default model, not 538 MB of float32), so the
    plan's TPOT bound and the implied MBU of a measured batch-1 run use those bytes."""
    from engine.loader import default_model_gguf

    try:
        default_model_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    out = json.loads(_run(capsys, "--model", "default", "--device", "cpu", "--json"))
    blocks = out["model"]["gguf_blocks"]
    assert blocks["block_rows"] in (8, 12, 64)
    # engine/gguf_blocks.py's figure for the same file: 112 MB instead of 538 MB.
    assert blocks["weight_bytes_per_small_step"] == pytest.approx(111.5e6, rel=0.01)
    assert out["decode"]["weight_bytes_per_step"] == blocks["weight_bytes_per_small_step"]
    kv_read = 425.5 * 46080  # the mean context's cached tokens
    assert out["decode"]["memory_time_s"] == pytest.approx((111.5e6 + kv_read) / FAKE_READ_BW,
                                                           rel=0.01)  # fmt: skip
    # A prefill's 350 rows are above the row limit: the layers' float32 weights; its one
    # logit row reads the head's blocks (113 MB of float32 -> 32 MB).
    head_saved = 113.2e6 - 31.9e6
    prefill = 538.06e6 - head_saved + 350 * 46080
    assert out["prefill"]["bytes"] == pytest.approx(prefill, rel=0.01)

    # A batch-1 run at the bound's own pace reads as an implied MBU of 1, not 4.8.
    result = _loadtest_result()
    result["points"][0]["summary"]["tpot_p50_s"] = out["decode"]["memory_time_s"]
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    data = json.loads(
        _run(capsys, "--model", "default", "--device", "cpu", "--measured", str(path),
             "--point", "0", "--json")
    )  # fmt: skip
    rows = {r["quantity"]: r for r in data["comparisons"][0]["rows"]}
    assert rows["TPOT"]["ratio"] == pytest.approx(1.0, rel=0.05)


def test_cpu_flags_skip_the_measurement(
    capsys: pytest.CaptureFixture[str], fake_cpu: FakeCpu
) -> None:
    out = json.loads(
        _run(capsys, "--device", "cpu", "--bandwidth-gbps", "50", "--tflops", "1", "--json")
    )
    assert out["device"]["memory_bandwidth"] == 50e9
    assert out["device"]["peak_flops"] == 1e12
    assert fake_cpu.bandwidth_calls == 0 and fake_cpu.flops_calls == []


def test_measured_results_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "result.json"
    path.write_text(json.dumps(_loadtest_result()))
    out = _run(capsys, "--model", "default", "--device", "a10", "--measured", str(path))
    assert "predicted vs measured" in out
    assert "[concurrency=1]" in out and "[concurrency=4]" in out
    assert "implied MBU" in out and "of bound" in out

    data = json.loads(
        _run(
            capsys,
            "--model",
            "default",
            "--device",
            "a10",
            "--measured",
            str(path),
            "--point",
            "concurrency=4",
            "--json",
        )
    )
    (comparison,) = data["comparisons"]
    # The point's concurrency and mean lengths become the planned workload.
    assert comparison["workload"]["batch"] == 4
    assert data["workload"] == {
        "prompt_tokens": 350,
        "output_tokens": 150,
        "batch": 4,
        "context": 8192,
    }
    rows = {row["quantity"]: row for row in comparison["rows"]}
    assert rows["TPOT"]["measured"] == 0.04
    # Implied MBU: the decode step's memory time over the measured TPOT.
    assert rows["TPOT"]["ratio"] == pytest.approx(data["decode"]["memory_time_s"] / 0.04)
    assert rows["output throughput"]["ratio"] == pytest.approx(
        95.0 / data["generation"]["output_tokens_per_s"]
    )
    assert 0 < rows["TTFT"]["ratio"] < 1


def test_measured_prometheus_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "metrics.txt"
    path.write_text(_prometheus_text([0.08] * 4 + [0.15] * 4, [0.015] * 20, 1200))
    data = json.loads(
        _run(capsys, "--model", "default", "--device", "cpu", "--measured", str(path), "--json")
    )
    (comparison,) = data["comparisons"]
    rows = {row["quantity"]: row for row in comparison["rows"]}
    assert rows["TTFT"]["measured"] == pytest.approx(0.1)
    assert rows["TPOT"]["ratio"] == pytest.approx(
        data["decode"]["memory_time_s"] / rows["TPOT"]["measured"]
    )
    assert rows["output throughput"]["measured"] is None
    # 1,200 generated tokens over 8 requests: the plan uses 150 output tokens.
    assert data["workload"]["output_tokens"] == 150


def test_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "nope"]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["--device", "t4", "--dtype", "bf16"]) == 2
    assert "bf16" in capsys.readouterr().err


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--list")
    assert "h100-sxm" in out and "llama-3-70b" in out and "cpu" in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--batch", "x"], "argument --batch: invalid int value: 'x'"),
        (["--kv-table-batches", "0"], "expected positive integers, got '0'"),
        (["--dtype", "q9"], "argument --dtype: invalid choice: 'q9'"),
    ],
)
def test_a_command_line_mistake_is_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert err.startswith("pagedserve plan: error: ") and "pagedserve plan --help" in err, err


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    """``pagedserve plan ... | head -1``: the pipe closes before the plan is printed; the
    command stops quietly (status 1, nothing on stderr), as Unix tools do."""
    import subprocess
    import sys

    argv = ["plan", "--model", "llama-3-8b", "--device", "h100-sxm"]
    code = f"import sys; from server.cli import main; sys.exit(main({argv!r}))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert err == ""
