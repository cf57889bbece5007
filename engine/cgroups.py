"""This process's control groups: which directories' limits apply to it, for one controller,
under cgroup v2 or v1. Read by the thread count (``engine/threads.py``: the CPU quota) and
the weights' memory check (``engine/weight_memory.py``: the memory limit); each reads its
own files in the directories found here."""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def read_text(path: Path) -> str | None:
    """A control file's stripped text, or None where it cannot be read."""
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def ancestors(root: Path, relative: str) -> list[Path]:
    """``root/relative`` and each of its parents up to ``root``: a limit on any of them
    limits the process."""
    parts = [p for p in relative.strip("/").split("/") if p and p != ".."]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def controller_directories(
    controller: str,
    v1_mounts: tuple[str, ...],
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    root: Path = CGROUP_ROOT,
) -> list[tuple[Path, bool]]:
    """Each directory whose ``controller`` limits apply to this process, innermost first,
    with whether it is cgroup v2's (its one hierarchy: the line "0::/path") or v1's (a line
    naming ``controller``, mounted at one of ``v1_mounts`` under ``root``). Empty where
    ``proc_cgroup`` cannot be read."""
    text = read_text(proc_cgroup)
    if text is None:
        return []
    found: list[tuple[Path, bool]] = []
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, relative = fields
        if controllers == "":  # v2: "0::/path"
            found += [(d, True) for d in ancestors(root, relative)]
        elif controller in controllers.split(","):  # v1: "4:cpu,cpuacct:/path"
            for mount in v1_mounts:
                found += [(d, False) for d in ancestors(root / mount, relative)]
    return found
