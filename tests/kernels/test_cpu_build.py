"""kernels/cpu/build.py: the first build survives a crash, a race and a broken toolchain.

Each scenario runs in child processes over a private ``TORCH_EXTENSIONS_DIR``. The real
compile takes minutes on a busy 2-core machine, so the children replace ``build._compile``
by a stand-in: one that "compiles" until it is killed (the kill window is then certain), or
one that copies the library this session already built (the ``ops`` fixture) into the
build directory. Loading, locking, renaming into place and cleaning up are the real code.
The broken-toolchain scenario runs the real compile with a compiler that fails. What a
first build logs is checked in this process, with the same kind of stand-in.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch.utils.cpp_extension

from kernels import cpu
from kernels.cpu import build
from tests.child_env import with_repo_on_path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import logging, shutil, sys, time
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from kernels.cpu import build
mode, real = sys.argv[1], sys.argv[2]

def stand_in(name, sources, build_dir, *args):
    if mode == "hang":
        (build_dir / "paged_attention.o").write_bytes(b"")  # one source "done"
        print("COMPILING", flush=True)
        time.sleep(600)
    if mode == "forbidden":
        print("COMPILED", flush=True)
    shutil.copy(real, build_dir / f"{name}.so")
    return build_dir / f"{name}.so"

if mode != "real":
    build._compile = stand_in
from kernels import cpu
ops = cpu.load()
print("LOADED" if ops is not None and ops.max_quant_rows() > 0 else "REFERENCE", flush=True)
"""


def _env(ext: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_CPU_KERNELS"}
    return with_repo_on_path(env, TORCH_EXTENSIONS_DIR=str(ext), **extra)


def _run(ext: Path, mode: str, real: Path, timeout: float = 120, **extra: str):
    return subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(real)],
        cwd=ROOT,
        env=_env(ext, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _start_hanging_build(ext: Path, real: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "hang", str(real)],
        cwd=ROOT,
        env=_env(ext),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()  # blocks until the stand-in compile has started
    assert line.strip() == "COMPILING", line
    return child


def _warnings(stderr: str) -> list[str]:
    """Warning lines: ours (logging's format above) and torch's (glog's 'W1126 ...')."""
    return [
        line
        for line in stderr.splitlines()
        if "WARNING" in line or re.match(r"W\d{4} ", line) or "Warning" in line
    ]


def _build_dirs(ext: Path) -> list[Path]:
    return sorted(ext.glob(".build-*"))


def test_ninja_found_through_the_pip_package(monkeypatch, tmp_path):
    """A PATH without ninja (a venv's python run without activating the venv): the build
    puts the ninja of the PyPI package (a dependency) on PATH, where torch looks for it."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not torch.utils.cpp_extension.is_ninja_available()
    with build.ninja_on_path():
        found = shutil.which("ninja")
        assert found is not None, "no pip-installed ninja: `pip install ninja`"
        assert Path(found).parent in build._ninja_dirs()
        assert torch.utils.cpp_extension.is_ninja_available()
    assert os.environ["PATH"] == str(tmp_path)


def test_a_build_killed_midway_does_not_block_the_next_start(ops, tmp_path):
    real = cpu.library_path()
    assert real is not None and real.is_file()
    ext = tmp_path / "ext"
    # What torch's own loader left behind after such a kill (issue 34): irrelevant now.
    (ext / "pagedserve_cpu").mkdir(parents=True)
    (ext / "pagedserve_cpu" / "lock").touch()

    child = _start_hanging_build(ext, real)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert len(_build_dirs(ext)) == 1, "the killed build should have left its private dir"

    started = time.monotonic()
    done = _run(ext, "copy", real)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "LOADED", done.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert "left by a build that did not finish" in done.stderr
    assert _build_dirs(ext) == []
    assert not _warnings(done.stderr), done.stderr
    # A third start finds the finished build and compiles nothing.
    again = _run(ext, "forbidden", real)
    assert again.stdout.strip().splitlines() == ["LOADED"], again.stdout + again.stderr[-2000:]
    assert "cached build loaded" in again.stderr


def test_a_live_builder_is_waited_for_a_bounded_time(ops, tmp_path):
    """Another process is compiling (it holds the lock, alive) for longer than the wait: the
    start goes on with the reference path after one warning line, compiling nothing."""
    real = cpu.library_path()
    assert real is not None
    ext = tmp_path / "ext"
    holder = _start_hanging_build(ext, real)
    try:
        started = time.monotonic()
        done = _run(ext, "forbidden", real, PAGEDSERVE_CPU_BUILD_WAIT_S="1")
        took = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines() == ["REFERENCE"], done.stdout
    warnings = _warnings(done.stderr)
    assert len(warnings) == 1, done.stderr
    assert "another process has been compiling them for over 1 s" in warnings[0]
    assert took < 60


def test_a_broken_compiler_gives_one_warning_and_the_reference(tmp_path):
    """The real build with a compiler that reports a version and fails every compile, then
    with no compiler at all: one warning line each, the reference path, nothing left behind
    and the lock free."""
    compiler = tmp_path / "broken-c++"
    compiler.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--version*|*-dumpversion*|*-dumpfullversion*) exec c++ "$@";; esac\n'
        'echo "broken-c++: error: this toolchain is broken" >&2\nexit 1\n'
    )
    compiler.chmod(0o755)
    missing = tmp_path / "missing-c++"
    for cxx, expect in ((compiler, "this toolchain is broken"), (missing, "no C++ compiler")):
        ext = tmp_path / f"ext-{cxx.name}"
        done = _run(ext, "real", Path("/nonexistent"), timeout=300, CXX=str(cxx))
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines() == ["REFERENCE"], done.stdout
        warnings = _warnings(done.stderr)
        assert len(warnings) == 1, done.stderr
        assert "C++ CPU kernels unavailable" in warnings[0] and expect in warnings[0]
        assert _build_dirs(ext) == []
        for lock in ext.glob("*.lock"):
            with open(lock) as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if still held


def test_a_first_build_logs_what_it_does_its_progress_and_time(monkeypatch, tmp_path, caplog):
    """A first start's log: one line naming the compile, once per machine, before it;
    progress lines while it runs (how many sources are done); a line with its time after.
    The stand-in "compiles" one source, waits for the progress line that counts it, then
    the other; nothing is loaded (the library it writes is not a real one)."""
    sources = [tmp_path / "a.cpp", tmp_path / "b.cpp"]
    for source in sources:
        source.write_text(f"// {source.name}\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("CXX", sys.executable)  # found on PATH; the stand-in runs nothing
    monkeypatch.setattr(build, "PROGRESS_EVERY_S", 0.02)
    loaded: list[Path] = []
    monkeypatch.setattr(build, "_load", loaded.append)

    def progress_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "sources done" in r.getMessage()]

    def stand_in(name, sources, build_dir, *args):
        (build_dir / "a.o").write_bytes(b"")
        deadline = time.monotonic() + 30
        while not any("1/2 sources done" in line for line in progress_lines()):
            assert time.monotonic() < deadline, "no progress line within 30 s"
            time.sleep(0.01)
        (build_dir / "b.o").write_bytes(b"")
        (build_dir / f"{name}.so").write_bytes(b"")
        return build_dir / f"{name}.so"

    monkeypatch.setattr(build, "_compile", stand_in)
    caplog.set_level(logging.INFO, logger="kernels.cpu")
    library = build.load_or_build("pagedserve_test", sources, [], ["-O2"], [])
    assert loaded == [library] and library.is_file()

    messages = [r.getMessage() for r in caplog.records if r.name == "kernels.cpu"]
    first, last = messages[0], messages[-1]
    assert first.startswith("compiling the C++ CPU kernels for this machine (once per machine")
    assert "progress every 0.02 s" in first and str(library.parent) in first
    assert re.fullmatch(r"compiled the C\+\+ CPU kernels in \d+ s", last), last
    progress = progress_lines()
    assert progress and messages.index(progress[0]) > 0
    assert all(
        re.fullmatch(r"compiling the C\+\+ CPU kernels: [0-2]/2 sources done, \d+ s so far", line)
        for line in progress
    ), progress
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
