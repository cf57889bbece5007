"""engine/threads.py: the CPU thread count comes from the flag, OMP_NUM_THREADS, or the CPUs
the process may use (affinity mask, cgroup v2/v1 quota, the smallest quota up the tree)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine import threads
from server.config import ServingConfig


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_smallest_up_the_tree(tmp_path):
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/kubepods/pod1/ctr\n")
    root = tmp_path / "cg"
    _write(root / "kubepods/pod1/ctr/cpu.max", "max 100000\n")  # no limit on the container
    _write(root / "kubepods/pod1/cpu.max", "150000 100000\n")  # 1.5 CPUs on the pod
    _write(root / "kubepods/cpu.max", "400000 100000\n")
    cpus, source = threads.cgroup_cpu_quota(proc, root)
    assert cpus == 1.5
    assert source == str(root / "kubepods/pod1/cpu.max")


def test_cgroup_v1_cfs_quota(tmp_path):
    proc = tmp_path / "proc_cgroup"
    _write(proc, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    root = tmp_path / "cg"
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "200000\n")
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    _write(root / "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")  # the root: unlimited
    _write(root / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert threads.cgroup_cpu_quota(proc, root) == (
        2.0,
        str(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us"),
    )


def test_no_quota(tmp_path):
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/\n")
    root = tmp_path / "cg"
    _write(root / "cpu.max", "max 100000\n")
    assert threads.cgroup_cpu_quota(proc, root) is None
    assert threads.cgroup_cpu_quota(tmp_path / "missing", root) is None


def test_a_quota_below_the_affinity_mask_wins_rounded_up(monkeypatch):
    monkeypatch.setattr(threads, "_affinity", lambda: 8)
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: (2.5, "/sys/fs/cgroup/cpu.max"))
    count, source = threads.usable_cpus()
    assert count == 3
    assert "quota 2.5" in source
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: None)
    assert threads.usable_cpus() == (8, "8 CPUs in the affinity mask")


def test_affinity_mask_counts(monkeypatch):
    """Run under a one-CPU affinity mask: the count follows it (the machine may have more)."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity here")
    before = os.sched_getaffinity(0)
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: None)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert threads.usable_cpus() == (1, "1 CPUs in the affinity mask")
    finally:
        os.sched_setaffinity(0, before)


def test_precedence_flag_then_omp_then_usable(monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: (5, "5 CPUs in the affinity mask"))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.choose_num_threads(2) == (2, "--num-threads")
    assert threads.choose_num_threads(None) == (3, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.choose_num_threads(None) == (5, "5 CPUs in the affinity mask")


def test_configure_threads_sets_torch(monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        assert threads.configure_threads(1) == (1, "--num-threads")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_num_threads_flag_and_env():
    assert ServingConfig.from_cli([], {}).server.num_threads is None
    assert ServingConfig.from_cli(["--num-threads", "3"], {}).server.num_threads == 3
    env = {"PAGEDSERVE_NUM_THREADS": "2"}
    assert ServingConfig.from_cli([], env).server.num_threads == 2
    assert ServingConfig.from_cli(["--num-threads", "auto"], env).server.num_threads is None
    with pytest.raises(SystemExit):
        ServingConfig.from_cli(["--num-threads", "0"], {})
