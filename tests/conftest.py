"""Suite-wide set-up.

Without CUDA the Triton kernels run under Triton's interpreter. Triton decides
interpreter-or-compiler when a ``@triton.jit`` function is defined (when ``kernels.<name>``
is first imported), so the switch is set here, before any test module imports a kernel.

Every test runs isolated from the tests after it in the same process (``_isolated``): the
process-wide state of tests/isolation.py is compared and put back, and on a GPU the test's
CUDA work is synchronised, so that an asynchronous fault is reported at the test that caused
it. A fault that leaves the CUDA context unusable (illegal address, device-side assert: the
error is sticky, every later CUDA call in the process fails) fails that test, fails the GPU
tests after it in a serial run with its name, and under ``pytest -n`` ends the worker after
the test so that pytest-xdist runs the rest of its tests in a fresh process.
"""

from __future__ import annotations

import gc
import os
import warnings
from typing import NoReturn

import pytest
import torch

from tests import isolation

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A GPU test that still holds this much more CUDA memory after it than before (its tensors
# gone, the cache emptied) is named in a warning: under ``pytest -n`` every worker shares the
# GPU, and memory one worker holds is missing for the others' kernels (Triton loads each
# compiled kernel outside torch's allocator, so torch cannot free its cache to make room).
LEAK_WARN_BYTES = 1 << 30

# Set when a test left this process's CUDA context unusable: which test, and the error.
_cuda_broken_by: str | None = None


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _cuda_usable() -> bool:
    """Whether a trivial CUDA round trip still works (a sticky error fails every call)."""
    try:
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception:  # noqa: BLE001 - any failure means unusable
        return False


def _cuda_settings() -> tuple[float, int]:
    """The allocator's per-process memory fraction and the sync debug mode."""
    return torch.cuda.get_per_process_memory_fraction(), torch.cuda.get_sync_debug_mode()


def _restore_cuda_settings(before: tuple[float, int]) -> list[str]:
    fraction, debug_mode = _cuda_settings()
    changes = []
    if fraction != before[0]:
        changes.append(f"the per-process CUDA memory fraction {before[0]} -> {fraction}")
        torch.cuda.set_per_process_memory_fraction(before[0])
    if debug_mode != before[1]:
        changes.append(f"the CUDA sync debug mode {before[1]} -> {debug_mode}")
        torch.cuda.set_sync_debug_mode(before[1])
    return changes


def _check_cuda(nodeid: str) -> list[str]:
    """After a test: its CUDA work finished without error, no stream is left capturing a
    graph and the default stream is current again. One line per problem; records a sticky
    fault in ``_cuda_broken_by``."""
    global _cuda_broken_by
    problems: list[str] = []
    try:
        # Asked first: a synchronize would invalidate an open capture. The query itself
        # raises once a kernel has faulted (it reads the stream's status), so it sits in
        # the same try as the synchronize.
        if torch.cuda.is_current_stream_capturing():
            _cuda_broken_by = f"{nodeid} left a CUDA graph capture open"
            return ["a CUDA graph capture was left open on the current stream"]
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError or a subclass
        error = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        sticky = not _cuda_usable()
        if sticky:
            _cuda_broken_by = f"{nodeid} broke this process's CUDA context ({error})"
        return [
            f"a CUDA error surfaced when the test's work was synchronised, so it comes from "
            f"a kernel or copy this test launched after its last synchronisation: {error}"
            + ("; it is sticky: every later CUDA call in this process fails" if sticky else "")
        ]
    if torch.cuda.current_stream() != torch.cuda.default_stream():
        problems.append(f"the current CUDA stream was left at {torch.cuda.current_stream()}")
        torch.cuda.set_stream(torch.cuda.default_stream())
    return problems


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest):
    """Fails a test that leaves process-wide state changed (after putting it back), and on a
    GPU one whose CUDA work fails when synchronised; then hands the memory the test freed
    back to the driver: torch's caching allocator keeps freed blocks for its own process, so
    under ``pytest -n`` on one GPU one worker's pools (the int64-offset tests' 8 GiB caches,
    a dummy model's weights) would starve the other workers."""
    gpu_test = request.node.get_closest_marker("gpu") is not None
    if _cuda_broken_by is not None and gpu_test:
        pytest.fail(f"not run: {_cuda_broken_by}", pytrace=False)
    before = isolation.snapshot()
    # Compared only where CUDA was in use before the test (the test that initialises CUDA
    # has nothing to compare with).
    settings_before = _cuda_settings() if _cuda_in_use() else None
    held_before = torch.cuda.memory_allocated() if gpu_test and _cuda_in_use() else 0
    yield
    problems = isolation.restore(before)
    # Once the context is broken, its culprit is named; the tests after it are not.
    if _cuda_in_use() and _cuda_broken_by is None:
        problems += _check_cuda(request.node.nodeid)
        if settings_before is not None and _cuda_broken_by is None:
            problems += _restore_cuda_settings(settings_before)
        if _cuda_broken_by is None:
            if gpu_test:
                gc.collect()  # engines and graphs hold memory through reference cycles
                held = torch.cuda.memory_allocated() - held_before
                if held >= LEAK_WARN_BYTES:
                    warnings.warn(
                        f"{request.node.nodeid} still holds {held / 2**30:.1f} GiB of CUDA "
                        "memory after it (a module-scoped fixture, or a leak)",
                        stacklevel=1,
                    )
            torch.cuda.empty_cache()
    if problems:
        pytest.fail(
            "the test left this process changed for the tests after it (what can be put "
            "back was):\n  " + "\n  ".join(problems),
            pytrace=False,
        )


def refuse_the_default_gpu_kv_budget(*args: object, **kwargs: object) -> NoReturn:
    """Stands in for ``engine.gpu_memory.gpu_kv_budget`` where ``engine/builder.py`` calls it:
    the one place an engine on CUDA sizes its KV cache without a budget of its own."""
    pytest.fail(
        "this test built an engine on CUDA without an explicit KV budget: pass num_kv_blocks= "
        "or kv_cache_memory= (--num-kv-blocks / --kv-cache-memory on a command line). The "
        "default takes 90% of the GPU's free memory, which under pytest -n starves the other "
        "workers on the same GPU",
        pytrace=False,
    )


@pytest.fixture(autouse=True)
def _explicit_kv_budget():
    """On a machine with CUDA, an engine built in a test must bring its own KV budget
    (``refuse_the_default_gpu_kv_budget``). A no-op without CUDA, where no engine reaches
    that branch. A test that means to measure the default budget sets
    ``engine.builder.gpu_kv_budget`` back with its own ``monkeypatch``. Engines in a child
    process (``python -m server``) are outside this guard: their command lines pass
    ``--num-kv-blocks`` or ``--device cpu``."""
    if not torch.cuda.is_available():
        yield
        return
    # Already imported by the collection of the engine tests in every worker.
    from engine import builder

    # Set and put back by hand, not with the ``monkeypatch`` fixture: a fixture this one
    # requested would be set up before ``_isolated`` and torn down after it, so a test's own
    # ``monkeypatch.setenv`` would still be in place when ``_isolated`` compares.
    real = builder.gpu_kv_budget
    builder.gpu_kv_budget = refuse_the_default_gpu_kv_budget
    try:
        yield
    finally:
        builder.gpu_kv_budget = real


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under pytest-xdist, a worker whose CUDA context a test broke exits once that test's
    reports are sent: xdist then reports the test as the one the worker crashed in and runs
    the worker's remaining tests in a fresh process, instead of every one of them failing
    here on the same sticky error."""
    result = yield
    if _cuda_broken_by is not None and os.environ.get("PYTEST_XDIST_WORKER"):
        os.write(2, f"\n{_cuda_broken_by}: ending this pytest-xdist worker\n".encode())
        os._exit(3)
    return result


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
        # Sorted: pytest-xdist reports tests as its workers finish them, in no fixed order.
        f"{_by_file(sorted(nodeids))} ({reason})"
        for reason, nodeids in sorted(by_reason.items())
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
