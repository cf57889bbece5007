"""kernels/cpu/scratch.py: a scratch directory is removed once its owner is certainly gone,
and only then; an owner in another pid namespace (a container sharing this hostname and the
cache volume) or on another host cannot be checked, so its directory waits for the age
limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kernels.cpu import scratch

PREFIX = ".convert-"
DAY_S = 24 * 3600.0


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


def _named(parent: Path, host: str, namespace: str, pid: int, start: str = "12345") -> Path:
    path = parent / f"{PREFIX}{host}+{namespace}+{pid}+{start}+abc123"
    path.mkdir(parents=True)
    return path


def test_the_owner_token_names_the_pid_namespace(tmp_path: Path) -> None:
    host, namespace, pid, start = scratch.owner_token().split("+")
    assert host == scratch._host() and pid == str(os.getpid()) and start != "0"
    assert namespace == str(os.stat("/proc/self/ns/pid").st_ino)
    made = scratch.make_scratch_dir(tmp_path, PREFIX)
    assert made.name.startswith(f"{PREFIX}{scratch.owner_token()}+")


def test_a_dead_owner_is_removed_only_in_this_pid_namespace(tmp_path: Path) -> None:
    host, namespace = scratch._host(), scratch._pid_namespace()
    dead = _dead_pid()
    here = _named(tmp_path, host, namespace, dead)
    # The same host name and pid, another pid namespace: that pid may be alive there.
    other_namespace = _named(tmp_path, host, str(int(namespace) + 1), dead)
    other_host = _named(tmp_path, host + "-other", namespace, dead)
    live = scratch.make_scratch_dir(tmp_path, PREFIX)  # this process's own, alive
    older_version = tmp_path / f"{PREFIX}{host}+{dead}+12345+abc123"  # no namespace field
    older_version.mkdir()

    removed = scratch.remove_stale_scratch_dirs(tmp_path, PREFIX, max_age_s=DAY_S)
    assert removed == [here]
    assert other_namespace.is_dir() and other_host.is_dir() and live.is_dir()
    assert older_version.is_dir()

    # Past the age limit, whoever made them: all but the live one's (which is as new).
    past = time.time() - 2 * DAY_S
    for path in (other_namespace, other_host, older_version):
        os.utime(path, (past, past))
    removed = scratch.remove_stale_scratch_dirs(tmp_path, PREFIX, max_age_s=DAY_S)
    assert sorted(removed) == sorted([other_namespace, other_host, older_version])
    assert [p.name for p in tmp_path.iterdir()] == [live.name]
