"""The suite's per-test isolation (tests/isolation.py, ``_isolated`` in tests/conftest.py):
a test that leaves process-wide state changed is failed by name and the state put back, so
the tests after it in the same process (or pytest-xdist worker) see what they would alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernels
from tests import isolation

ROOT = Path(__file__).resolve().parents[1]


def test_nothing_changed_reports_nothing():
    assert isolation.restore(isolation.snapshot()) == []


def test_default_dtype_and_grad_mode_are_reported_and_put_back():
    before = isolation.snapshot()
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(not before.grad_enabled)
    changes = isolation.restore(before)
    assert changes == [
        "torch default dtype torch.float32 -> torch.float64",
        f"grad mode {before.grad_enabled} -> {not before.grad_enabled}",
    ]
    assert torch.get_default_dtype() == torch.float32
    assert torch.is_grad_enabled() == before.grad_enabled


def test_triton_interpret_toggle_is_reported_and_put_back(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = isolation.snapshot()
    os.environ["TRITON_INTERPRET"] = "1"
    assert isolation.restore(before) == ["TRITON_INTERPRET None -> '1'"]
    assert "TRITON_INTERPRET" not in os.environ


def test_a_rebound_kernel_global_is_reported_and_put_back():
    """What ``monkeypatch.setattr`` undoes and a plain assignment does not."""
    from kernels import _common

    original = _common.num_compute_units
    before = isolation.snapshot()
    _common.num_compute_units = lambda device: 132  # type: ignore[assignment]
    try:
        changes = isolation.restore(before)
    finally:
        _common.num_compute_units = original  # type: ignore[assignment]
    assert changes == [
        "kernels._common.num_compute_units rebound (monkeypatch restores what it sets)"
    ]
    assert _common.num_compute_units is original
    assert ("kernels", "__name__") not in before.kernel_globals  # dunders are not state
    assert before.kernel_globals[("kernels", "reference")] is kernels.reference


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run below expects a CPU-only torch")
def test_a_leaking_test_fails_by_name_and_the_next_one_runs_clean(tmp_path: Path):
    """A real pytest run with this suite's conftest: the leaking test errors at teardown,
    naming what it changed, and the test after it sees the default dtype it expects."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import _isolated  # noqa: F401\n")
    (tmp_path / "test_leak.py").write_text(
        textwrap.dedent(
            """
            import torch

            def test_leaks():
                torch.set_default_dtype(torch.float64)

            def test_after():
                assert torch.get_default_dtype() == torch.float32
            """
        )
    )
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "2 passed, 1 error" in out, out
    assert "ERROR at teardown of test_leaks" in out, out
    assert "torch default dtype torch.float32 -> torch.float64" in out, out
