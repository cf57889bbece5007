"""loadtest/launcher.py: ServerProcess.start_healthy stops a child that never comes up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loadtest.launcher import ServerProcess, free_port


def test_a_child_that_never_listens_is_stopped_after_the_timeout(tmp_path: Path) -> None:
    port = free_port()
    child = ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"], port,
                          tmp_path / "log")  # fmt: skip
    with pytest.raises(RuntimeError, match="not healthy after"):
        child.start_healthy(0.5, grace_s=5)
    assert child.process.poll() is not None  # stopped, not left running


def test_a_child_that_exits_during_start_up_names_its_exit(tmp_path: Path) -> None:
    port = free_port()
    child = ServerProcess([sys.executable, "-c", "raise SystemExit(3)"], port, tmp_path / "log")
    with pytest.raises(RuntimeError, match="exited with code 3"):
        child.start_healthy(30, grace_s=5)
    assert child.process.returncode == 3
