"""How many threads the CPU compute of a server process uses, and why.

torch's default is the machine's physical core count. In a container with a CPU quota, or a
process pinned to some cores (taskset, a cpuset), that is more threads than the process can
run at once: a thread that cannot get a core holds up every parallel kernel that waits for it
(the C++ kernels' team, each OpenMP region). So the default here is the CPUs the process may
actually use: its affinity mask (``sched_getaffinity``) and its cgroup's CPU quota (v2
``cpu.max``, v1 ``cpu.cfs_quota_us``), whichever is smaller, a fractional quota rounded up.
``--num-threads`` (``PAGEDSERVE_NUM_THREADS``) or ``OMP_NUM_THREADS`` overrides it.

torch's count is also the team size of the C++ kernels (``at::get_num_threads()``), so this
is the one place that decides both. What it cannot see at start-up, a neighbour process that
later keeps one of these CPUs busy, the fused stack handles step by step: it runs fewer of
the team's threads while others hold some of the CPUs (kernels/cpu/csrc/contention.h).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from engine.cgroups import CGROUP_ROOT, controller_directories, read_text


def _affinity() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def cgroup_cpu_quota(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT
) -> tuple[float, str] | None:
    """The smallest CPU quota (in CPUs) of the process's cgroup and its parents, with the
    file it came from; None where there is none."""
    best: tuple[float, str] | None = None

    def consider(cpus: float, source: Path) -> None:
        nonlocal best
        if cpus > 0 and (best is None or cpus < best[0]):
            best = (cpus, str(source))

    v1_mounts = ("cpu,cpuacct", "cpu", "cpuacct,cpu")
    for directory, v2 in controller_directories("cpu", v1_mounts, proc_cgroup, root):
        if v2:  # "quota period", or "max period"
            value = read_text(directory / "cpu.max")
            if value is None:
                continue
            quota, _, period = value.partition(" ")
            if quota != "max" and quota.isdigit() and period.isdigit() and int(period):
                consider(int(quota) / int(period), directory / "cpu.max")
        else:
            quota = read_text(directory / "cpu.cfs_quota_us")
            period = read_text(directory / "cpu.cfs_period_us")
            if quota and period and quota.lstrip("-").isdigit() and period.isdigit():
                if int(quota) > 0 and int(period) > 0:
                    consider(int(quota) / int(period), directory / "cpu.cfs_quota_us")
    return best


def usable_cpus() -> tuple[int, str]:
    """The CPUs this process may use at once, and how that was found."""
    affinity = _affinity()
    count = affinity or os.cpu_count() or 1
    source = f"{count} CPUs in the affinity mask" if affinity else f"{count} CPUs"
    quota = cgroup_cpu_quota()
    if quota is not None and math.ceil(quota[0]) < count:
        count = math.ceil(quota[0])
        source = f"cgroup CPU quota {quota[0]:g} CPUs ({quota[1]})"
    return max(1, count), source


def choose_num_threads(requested: int | None) -> tuple[int, str]:
    """The thread count for CPU compute: ``requested`` (``--num-threads``), else
    ``OMP_NUM_THREADS``, else the CPUs this process may use; and where it came from."""
    if requested is not None:
        return requested, "--num-threads"
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    return usable_cpus()


def configure_threads(requested: int | None) -> tuple[int, str]:
    """Set torch's intra-op thread count (and so the C++ kernels' team size) from
    ``choose_num_threads``; return what it chose and why. Call it before the thread that
    runs the model starts: a thread takes torch's count when it first runs torch's parallel
    code, and keeps it."""
    import torch

    count, source = choose_num_threads(requested)
    torch.set_num_threads(count)
    return count, source
