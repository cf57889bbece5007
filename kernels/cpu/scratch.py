"""Private scratch directories named after the process that owns them, and the removal of
those whose owner is gone.

A slow job that several processes may run at once into one shared cache (compiling the C++
kernels, converting a GGUF file) writes into a private directory and renames it into place
only when complete, so a reader never sees half a result. A job killed part-way (SIGKILL, the
OOM killer, a container restart) leaves its scratch directory behind; the next process that
runs the job removes it, and only it: the name says which process on which host made the
directory, so a live job's directory, possibly another server's, is never touched.

Owner identity is ``<host>+<pid namespace>+<pid>+<start time>``: the start time
(``/proc/<pid>/stat``) tells a dead owner from a new process that reuses its pid, as happens
when a container restarts and its server is again pid 1. A pid means something only inside
its pid namespace (the inode of ``/proc/self/ns/pid``): containers that share a hostname and
a cache volume but not a pid namespace would otherwise take each other's live owners for
dead ones (pid 1 in one container is not pid 1 in the other). A directory from another
host or pid namespace (a cache on a shared volume) cannot be checked, so it is removed only
once it is older than ``max_age_s``.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None  # field 22 of the whole line


def _host() -> str:
    # '+' separates the owner fields; hostnames never contain it.
    return socket.gethostname().replace("+", "-") or "localhost"


def _pid_namespace() -> str:
    """The inode of this process's pid namespace, or "0" where there is none to read."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def owner_token() -> str:
    """This process's identity as it appears in the names of its scratch directories."""
    return f"{_host()}+{_pid_namespace()}+{os.getpid()}+{_start_time(os.getpid()) or 0}"


def make_scratch_dir(parent: Path, prefix: str) -> Path:
    """A new empty directory ``<parent>/<prefix><owner>+<random>`` owned by this process."""
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{owner_token()}+", dir=parent))


def _owner_gone(token: str) -> bool:
    """Whether the process named by ``<host>+<pid namespace>+<pid>+<start>`` has certainly
    exited (never, for one of another host or pid namespace: its pid cannot be checked)."""
    host, namespace, pid_text, start = token.split("+")
    if host != _host() or namespace != _pid_namespace() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        # Our pid, but not a directory of ours (callers clean before they make theirs): a
        # previous process that had the same pid.
        return _start_time(pid) != start or start == "0"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    actual = _start_time(pid)
    return actual is not None and start != "0" and actual != start


def remove_stale_scratch_dirs(parent: Path, prefix: str, *, max_age_s: float) -> list[Path]:
    """Remove the ``prefix`` scratch directories under ``parent`` whose owner is gone, or that
    are older than ``max_age_s`` whatever their owner; return those removed."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(prefix) or not entry.is_dir():
            continue
        # <prefix><host>+<pid namespace>+<pid>+<start>+<random>; the prefix may hold '+'
        # itself. A name of fewer fields (an older version's) is judged by its age alone.
        parts = entry.name[len(prefix) :].split("+")
        try:
            old = now - entry.stat().st_mtime > max_age_s
        except OSError:
            continue  # removed meanwhile
        if old or (len(parts) >= 5 and _owner_gone("+".join(parts[-5:-1]))):
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    return removed
