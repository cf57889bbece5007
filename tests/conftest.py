"""Suite-wide set-up.

Without CUDA the Triton kernels run under Triton's interpreter. Triton decides
interpreter-or-compiler when a ``@triton.jit`` function is defined (when ``kernels.<name>``
is first imported), so the switch is set here, before any test module imports a kernel.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _release_cuda_cache():
    """On a GPU, hand what a test freed back to the driver after it: torch's caching
    allocator keeps freed blocks for its own process, so under ``pytest -n`` on one GPU the
    pools one worker's large tests leave (the int64-offset tests' 8 GiB caches, the kernel
    benchmarks' inputs) would starve the other workers."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def ops():
    """``torch.ops.pagedserve_cpu``, the C++ CPU kernels. Tests that use it fail (rather than
    skip) when the extension cannot be built, so a machine without a compiler is noticed and
    not taken for a silent slowdown; ``PAGEDSERVE_CPU_KERNELS=0`` skips them on purpose."""
    from kernels import cpu

    if os.environ.get("PAGEDSERVE_CPU_KERNELS") == "0":
        pytest.skip("C++ CPU kernels disabled by PAGEDSERVE_CPU_KERNELS=0")
    built = cpu.load()
    assert built is not None, "the C++ CPU kernels did not build (see the warning logged)"
    return built


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line naming every skipped check and why, even under ``-q`` (which hides skip
    reasons): a missing tool (prometheus, docker compose, hadolint) must not pass for a
    green run."""
    reports = terminalreporter.stats.get("skipped", [])
    by_reason: dict[str, list[str]] = {}
    for report in reports:
        longrepr = getattr(report, "longrepr", None)
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        by_reason.setdefault(reason, []).append(report.nodeid)
    if not by_reason:
        return
    groups = "; ".join(
        f"{_by_file(nodeids)} ({reason})" for reason, nodeids in sorted(by_reason.items())
    )
    terminalreporter.write_line(f"SKIPPED {len(reports)} checks: {groups}", yellow=True)


def _by_file(nodeids: list[str]) -> str:
    """``a.py::{t1, t2}, b.py::t3``: each file once."""
    names: dict[str, list[str]] = {}
    for nodeid in nodeids:
        path, _, name = nodeid.partition("::")
        names.setdefault(path, []).append(name)
    return ", ".join(
        f"{path}::{tests[0]}" if len(tests) == 1 else f"{path}::{{{', '.join(tests)}}}"
        for path, tests in names.items()
    )
