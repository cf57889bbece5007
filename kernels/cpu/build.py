"""Compiling the C++ CPU kernels once per machine, in a way a crash or a race cannot wedge.

Layout under the extensions root (``$TORCH_EXTENSIONS_DIR``, else torch's default root)::

    <name>-<key>/<name>.so          a finished build; it appears whole, by one rename
    <name>-<key>.lock               flock()ed by the one process compiling <key>
    .build-<name>-<key>+<owner>+*/  that process's private build directory (scratch.py)
    <name>-<key>.failed.log         the compiler's output of the last failed build

``<key>`` hashes what the binary depends on: the sources, the flags, the torch and Python
versions, and for ``-march=native`` the CPU's model and feature flags (a cache volume that
moves to another CPU must not load instructions that CPU lacks).

Why not ``torch.utils.cpp_extension.load``'s own cache: it builds in place and guards the
directory with a lock *file* that a killed build leaves behind, and every later start then
waits on it for ever. Here the lock is an ``flock``, which the kernel drops when its holder
dies; the build runs in a private directory renamed into place only when complete; and the
wait for another live builder is bounded (``PAGEDSERVE_CPU_BUILD_WAIT_S``, default 600 s).
Anything that goes wrong raises ``BuildUnavailable`` with a one-line reason, never hangs.

torch looks for ``ninja`` on ``PATH``; the PyPI ``ninja`` package (a dependency) puts it in
the interpreter's ``bin`` directory, which is not on ``PATH`` when a venv's python runs
without the venv activated. ``ninja_on_path`` adds that directory for the build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from kernels.cpu.scratch import make_scratch_dir, remove_stale_scratch_dirs

log = logging.getLogger("kernels.cpu")

DEFAULT_WAIT_S = 600.0
# A build directory whose owner cannot be checked (another host) is removed past this age;
# a build takes minutes at most.
STALE_BUILD_AGE_S = 6 * 3600.0
# Seconds between the progress lines of a build.
PROGRESS_EVERY_S = 10.0


class BuildUnavailable(RuntimeError):
    """The kernels cannot be built or loaded now; the message is one line saying why."""


def extension_root() -> Path:
    """``$TORCH_EXTENSIONS_DIR``, else torch's default extensions root."""
    # The first import of torch's extension module: on a CUDA build of torch without a GPU,
    # where a CUDA toolkit is found, it logs "No CUDA runtime is found, using CUDA_HOME=...",
    # which says nothing about building CPU kernels.
    with _quiet_torch():
        from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _cpu_identity() -> str:
    """The CPU model and feature flags, which a native build is specific to."""
    keep = ("model name", "flags", "Features", "CPU part")
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = {line.split(":", 1)[0].strip(): line for line in f if ":" in line}
    except OSError:
        return ""
    return "".join(lines.get(name, "") for name in keep)


def build_key(sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    import torch

    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update("\0".join([*cflags, "|", *ldflags]).encode())
    digest.update(f"{torch.__version__}|{sys.version_info[:2]}|{sys.platform}".encode())
    if any(flag == "-march=native" for flag in cflags):
        digest.update(_cpu_identity().encode())
    return digest.hexdigest()[:16]


def _ninja_dirs() -> list[Path]:
    """Where a pip-installed ninja may be: the ``ninja`` package's own bin dir, the ``bin``
    beside the package (``pip install --target DIR`` puts the program in ``DIR/bin``, which
    ``BIN_DIR`` does not name) and the interpreter's."""
    dirs = []
    with contextlib.suppress(Exception):
        import ninja  # type: ignore[import-not-found]

        dirs.append(Path(ninja.BIN_DIR))
        dirs.append(Path(ninja.__file__).resolve().parents[1] / "bin")
    dirs.append(Path(sys.executable).parent)
    return [d for d in dirs if (d / "ninja").is_file() and os.access(d / "ninja", os.X_OK)]


@contextlib.contextmanager
def ninja_on_path() -> Iterator[None]:
    """``PATH`` with a pip-installed ninja on it when ``PATH`` has none, for the block."""
    before = os.environ.get("PATH")
    if shutil.which("ninja") is None:
        extra = [str(d) for d in _ninja_dirs()]
        if extra:
            os.environ["PATH"] = os.pathsep.join([*extra, *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def _compile(
    name: str,
    sources: Sequence[Path],
    build_dir: Path,
    include_dirs: Sequence[Path],
    cflags: Sequence[str],
    ldflags: Sequence[str],
) -> Path:
    """Compile into ``build_dir`` (through torch's ninja build); return the library. torch
    loads it too, which is harmless: loading it again from its final path finds the same
    file, already loaded."""
    from torch.utils.cpp_extension import load as load_extension

    load_extension(
        name=name,
        sources=[str(s) for s in sources],
        extra_include_paths=[str(d) for d in include_dirs],
        extra_cflags=list(cflags),
        extra_ldflags=list(ldflags),
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    return build_dir / f"{name}.so"


@contextlib.contextmanager
def _progress(build_dir: Path, num_sources: int, started: float) -> Iterator[None]:
    """Logs every PROGRESS_EVERY_S how many sources are compiled so far."""
    done = threading.Event()

    def report() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            objects = len(list(build_dir.glob("*.o")))
            log.info(
                "compiling the C++ CPU kernels: %d/%d sources done, %.0f s so far",
                objects,
                num_sources,
                time.monotonic() - started,
            )

    thread = threading.Thread(target=report, name="pagedserve-cpu-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """torch's extension loader logs a multi-line banner when the compiler is not the one
    torch was built with; a build that fails is reported by one line of ours instead, and
    one that works needs no warning."""
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    before = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        torch_log.setLevel(before)


def one_line(text: str) -> str:
    """A compiler's multi-line output as one line: its first error line (a build error
    starts with the long command line that failed, which says nothing), else its first."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower()]
    line = (errors or lines or ["unknown error"])[0]
    return line if len(line) <= 240 else line[:237] + "..."


def _try_lock(lock: IO[str]) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _load(library: Path) -> None:
    import torch

    torch.ops.load_library(str(library))


def load_or_build(
    name: str,
    sources: Sequence[Path],
    include_dirs: Sequence[Path],
    cflags: Sequence[str],
    ldflags: Sequence[str],
) -> Path:
    """Load the extension ``name`` from the cache, compiling it first if it is not there;
    return the library's path.

    Raises:
        BuildUnavailable: no compiler or ninja, a failed build, or another process compiling
            the same build for longer than ``PAGEDSERVE_CPU_BUILD_WAIT_S``.
    """
    root = extension_root()
    key = build_key([*sources, *_headers(include_dirs)], cflags, ldflags)
    final_dir = root / f"{name}-{key}"
    library = final_dir / f"{name}.so"
    if library.is_file():
        _load(library)
        log.info("C++ CPU kernels: cached build loaded from %s", final_dir)
        return library
    root.mkdir(parents=True, exist_ok=True)
    wait_s = float(os.environ.get("PAGEDSERVE_CPU_BUILD_WAIT_S") or DEFAULT_WAIT_S)
    lock_path = root / f"{name}-{key}.lock"
    with open(lock_path, "a+", encoding="utf-8") as lock:
        try:
            locked = _try_lock(lock)
        except OSError:  # a filesystem without flock: the private build dir alone keeps it safe
            locked = True
        if not locked:
            log.info(
                "another process is compiling the C++ CPU kernels (%s); waiting up to %.0f s",
                lock_path,
                wait_s,
            )
            deadline = time.monotonic() + wait_s
            while not (locked := _try_lock(lock)):
                if library.is_file() or time.monotonic() >= deadline:
                    break
                time.sleep(0.25)
        if library.is_file():  # built by the process that held the lock, or just now
            _load(library)
            log.info("C++ CPU kernels: loaded the build another process finished in %s",
                     final_dir)  # fmt: skip
            return library
        if not locked:
            raise BuildUnavailable(
                f"another process has been compiling them for over {wait_s:.0f} s "
                f"(it holds {lock_path}; PAGEDSERVE_CPU_BUILD_WAIT_S sets the wait)"
            )
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} compiling since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        lock.flush()
        _build_locked(name, key, root, final_dir, sources, include_dirs, cflags, ldflags)
    _load(library)
    return library


def _headers(include_dirs: Sequence[Path]) -> list[Path]:
    return sorted(p for d in include_dirs for p in d.glob("*.h"))


def _build_locked(
    name: str,
    key: str,
    root: Path,
    final_dir: Path,
    sources: Sequence[Path],
    include_dirs: Sequence[Path],
    cflags: Sequence[str],
    ldflags: Sequence[str],
) -> None:
    """Compile in a private directory, then rename it to ``final_dir``; the lock is held."""
    prefix = f".build-{name}-"
    for stale in remove_stale_scratch_dirs(root, prefix, max_age_s=STALE_BUILD_AGE_S):
        log.info("removed %s, left by a build that did not finish", stale)
    build_dir = make_scratch_dir(root, f"{prefix}{key}+")
    failed_log = root / f"{name}-{key}.failed.log"
    started = time.monotonic()
    log.info(
        "compiling the C++ CPU kernels for this machine (once per machine; up to a few "
        "minutes, progress every %g s); cached in %s",
        PROGRESS_EVERY_S,
        final_dir,
    )
    try:
        compiler = os.environ.get("CXX") or "c++"
        if shutil.which(compiler) is None:
            raise BuildUnavailable(f"no C++ compiler: {compiler!r} not found (install g++)")
        with ninja_on_path(), _quiet_torch(), _progress(build_dir, len(sources), started):
            built = _compile(name, sources, build_dir, include_dirs, cflags, ldflags)
        if not built.is_file():
            raise BuildUnavailable(f"the build produced no {built.name}")
        try:
            build_dir.rename(final_dir)
        except OSError:
            # Only possible where flock is not: another process finished the same build.
            if not (final_dir / built.name).is_file():
                raise
    except BuildUnavailable:
        raise
    except Exception as exc:
        text = str(exc).strip() or type(exc).__name__
        detail = ""
        if len(text.splitlines()) > 1:
            with contextlib.suppress(OSError):
                failed_log.write_text(text + "\n", encoding="utf-8")
                detail = f"; compiler output in {failed_log}"
        raise BuildUnavailable(f"build failed: {one_line(text)}{detail}") from exc
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    with contextlib.suppress(OSError):
        failed_log.unlink()
    log.info("compiled the C++ CPU kernels in %.0f s", time.monotonic() - started)
