"""A first start killed part-way (SIGKILL: the OOM killer, a container restart, a deploy
timeout) never stops the next start: the real server (``python -m server``) on a tiny GGUF
model, over a private ``TORCH_EXTENSIONS_DIR`` and ``PAGEDSERVE_CACHE``, is killed inside
the GGUF conversion, started again and killed inside the C++ kernel build, and started a
third time: healthy within the normal start time, with nothing left behind.

The real compile takes minutes on a busy 2-core machine, so the build goes through torch's
real ninja build with a stand-in compiler (``CXX``, which the build honours): one that
compiles until the test has killed its server, then one that "compiles" empty objects and
links the library this session already built (the ``ops`` fixture). The conversion of a
tiny file takes a second, too short to kill inside for certain, so the first start runs
tests/server/held_conversion_server.py, which holds the real conversion open once its
private directory exists. The cleanup, locking and renaming are the server's own code
(kernels/cpu/build.py, kernels/cpu/scratch.py, engine/loader.py).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from kernels import cpu
from loadtest.launcher import ServerProcess, free_port
from tests.server.held_conversion_server import HELD
from tests.server.tiny_gguf import write_tiny_gguf
from tests.server.tiny_server import REPO, STARTUP_TIMEOUT_S, server_argv

pytestmark = pytest.mark.slow

# A stand-in C++ compiler for torch's ninja build. Anything but a compile (-c) or a link
# (-shared), such as torch's `c++ -v` version check, goes to the real compiler.
STAND_IN_CXX = r"""#!/bin/sh
out=""; prev=""; step=other
for arg in "$@"; do
    [ "$prev" = "-o" ] && out="$arg"
    [ "$arg" = "-c" ] && step=compile
    [ "$arg" = "-shared" ] && step=link
    prev="$arg"
done
case "{mode}:$step" in
    hang:compile)
        # ninja starts each compile in a process group of its own, which a kill of the
        # server's group misses: wait until the test removes the marker (2 minutes at most).
        touch "{marker}"
        i=0
        while [ -e "{marker}" ] && [ "$i" -lt 600 ]; do sleep 0.2; i=$((i + 1)); done
        exit 1;;
    copy:compile) printf '%s:\n' "$out" > "$out.d"; : > "$out";;
    copy:link) cp "{library}" "$out";;
    *) exec c++ "$@";;
esac
"""
BUILD_STARTED = "compiling the C++ CPU kernels for this machine"


def stand_in_compiler(path: Path, mode: str, *, marker: Path, library: Path) -> Path:
    path.write_text(STAND_IN_CXX.format(mode=mode, marker=marker, library=library))
    path.chmod(0o755)
    return path


def start(module: str, model: Path, log: Path, env: dict[str, str]) -> ServerProcess:
    port = free_port()
    argv = server_argv(
        module, model, port,
        "--num-kv-blocks", "64",
        # Given peaks: a private cache would otherwise measure the CPU's (tens of seconds).
        "--peak-bandwidth-gbps", "10",
        "--peak-tflops", "0.1",
    )  # fmt: skip
    server = ServerProcess(argv, port, log, env=env, cwd=REPO)
    server.start()
    return server


def wait_for(server: ServerProcess, text: str, also: Path | None = None) -> None:
    """Until the log holds ``text`` (and ``also`` exists), the server still running."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.process.poll() is None, f"exited early:\n{server.log_tail()}"
        log = server.log_path.read_text(errors="replace")
        if text in log and (also is None or also.exists()):
            return
        time.sleep(0.05)
    raise AssertionError(f"never logged {text!r}:\n{server.log_tail()}")


def kill(server: ServerProcess) -> None:
    """SIGKILL the server's whole process group (it leads its own), as a container stop does."""
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)


def test_a_first_start_killed_midway_does_not_stop_the_next(ops, tmp_path: Path) -> None:
    library = cpu.library_path()
    assert library is not None and library.is_file()
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    ext, cache = tmp_path / "ext", tmp_path / "cache"
    models = cache / "models"
    # What torch's own extension loader left after such a kill (issue 34): ignored now.
    (ext / "pagedserve_cpu").mkdir(parents=True)
    (ext / "pagedserve_cpu" / "lock").touch()
    marker = tmp_path / "compiling"
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_CPU_KERNELS"}
    env |= {
        "TORCH_EXTENSIONS_DIR": str(ext),
        "PAGEDSERVE_CACHE": str(cache),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    hang = stand_in_compiler(tmp_path / "c++-hang", "hang", marker=marker, library=library)
    copy = stand_in_compiler(tmp_path / "c++-copy", "copy", marker=marker, library=library)

    # 1. Killed inside the GGUF conversion.
    first = start("tests.server.held_conversion_server", gguf, tmp_path / "first.log", env)
    try:
        wait_for(first, HELD)
    finally:
        kill(first)
    assert len(list(models.glob(".convert-*"))) == 1
    assert [p for p in models.iterdir() if not p.name.startswith(".")] == []

    # 2. The conversion is done again (its leftover removed), then killed inside the build.
    second = start("server", gguf, tmp_path / "second.log", env | {"CXX": str(hang)})
    try:
        wait_for(second, BUILD_STARTED, also=marker)
    finally:
        kill(second)
        marker.unlink(missing_ok=True)  # the stand-in compiles exit
    second_log = (tmp_path / "second.log").read_text(errors="replace")
    assert "left by a conversion that did not finish" in second_log
    assert list(models.glob(".convert-*")) == []
    assert len(list(ext.glob(".build-*"))) == 1

    # 3. Healthy within the normal start time; nothing left behind.
    third = start("server", gguf, tmp_path / "third.log", env | {"CXX": str(copy)})
    try:
        took = third.wait_healthy(STARTUP_TIMEOUT_S)
        r = httpx.post(
            f"{third.base_url}/v1/completions",
            json={"prompt": "hello", "max_tokens": 4, "temperature": 0},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        maps = Path(f"/proc/{third.process.pid}/maps").read_text()
    finally:
        third.stop(grace_s=20)
    third_log = (tmp_path / "third.log").read_text(errors="replace")
    assert "left by a build that did not finish" in third_log, third_log[-3000:]
    assert "another process is compiling" not in third_log
    assert "C++ CPU kernels unavailable" not in third_log
    assert list(ext.glob(".build-*")) == [] and list(models.glob(".convert-*")) == []
    # The server runs the kernels from the finished build, renamed into place.
    (built,) = ext.glob("pagedserve_cpu*-*/pagedserve_cpu*.so")  # any PAGEDSERVE_CPU_MARCH
    assert str(built) in maps
    print(f"third start healthy after {took:.1f} s")
