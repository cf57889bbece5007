"""The suite's per-test isolation (tests/isolation.py, ``_isolated`` in tests/conftest.py):
a test that leaves process-wide state changed is failed by name and the state put back, so
the tests after it in the same process (or pytest-xdist worker) see what they would alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernels
from tests import isolation
from tests.child_env import with_repo_on_path


def child_env() -> dict[str, str]:
    """The environment of a child pytest run over this suite's conftest: this one with the
    repository importable, less pytest-xdist's worker variables, which a run under
    ``pytest -n`` would pass on and which make the child's conftest act as a worker (a
    broken CUDA context then ends the child instead of failing its tests by name)."""
    return with_repo_on_path(
        {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    )


def run_child_pytest(tmp_path: Path, conftest: str, tests: str, *args: str) -> str:
    """Write ``conftest`` and ``tests`` (as test_scripted.py) into ``tmp_path``, run pytest
    over them in a child process with ``child_env()`` and ``-rA``, and return its output."""
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_scripted.py").write_text(tests)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), *args, str(tmp_path)],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    return done.stdout + done.stderr


def test_nothing_changed_reports_nothing():
    assert isolation.restore(isolation.snapshot()) == []


def test_default_dtype_and_grad_mode_are_reported_and_put_back():
    before = isolation.snapshot()
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(not before.grad_enabled)
    changes = isolation.restore(before)
    assert changes == [
        "torch default dtype torch.float32 -> torch.float64",
        f"grad mode {before.grad_enabled} -> {not before.grad_enabled}",
    ]
    assert torch.get_default_dtype() == torch.float32
    assert torch.is_grad_enabled() == before.grad_enabled


def test_triton_interpret_toggle_is_reported_and_put_back(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = isolation.snapshot()
    os.environ["TRITON_INTERPRET"] = "1"
    assert isolation.restore(before) == ["TRITON_INTERPRET None -> '1'"]
    assert "TRITON_INTERPRET" not in os.environ


def test_a_rebound_kernel_global_is_reported_and_put_back():
    """What ``monkeypatch.setattr`` undoes and a plain assignment does not."""
    from kernels import _common

    original = _common.num_compute_units
    before = isolation.snapshot()
    _common.num_compute_units = lambda device: 132  # type: ignore[assignment]
    try:
        changes = isolation.restore(before)
    finally:
        _common.num_compute_units = original  # type: ignore[assignment]
    assert changes == [
        "kernels._common.num_compute_units rebound (monkeypatch restores what it sets)"
    ]
    assert _common.num_compute_units is original
    assert ("kernels", "__name__") not in before.kernel_globals  # dunders are not state
    assert before.kernel_globals[("kernels", "reference")] is kernels.reference


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run below expects a CPU-only torch")
def test_a_leaking_test_fails_by_name_and_the_next_one_runs_clean(tmp_path: Path):
    """A real pytest run with this suite's conftest: the leaking test errors at teardown,
    naming what it changed, and the test after it sees the default dtype it expects."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import _isolated  # noqa: F401\n")
    (tmp_path / "test_leak.py").write_text(
        textwrap.dedent(
            """
            import torch

            def test_leaks():
                torch.set_default_dtype(torch.float64)

            def test_after():
                assert torch.get_default_dtype() == torch.float32
            """
        )
    )
    env = child_env()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "2 passed, 1 error" in out, out
    assert "ERROR at teardown of test_leaks" in out, out
    assert "torch default dtype torch.float32 -> torch.float64" in out, out


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


@pytest.fixture
def fake_cuda(monkeypatch):
    """tests/conftest.py's CUDA checks against a scripted ``torch.cuda``: what a GPU would
    answer after a test, with ``_cuda_broken_by`` put back afterwards."""
    from tests import conftest

    state = {"capturing": False, "error": None, "usable": True, "stream": "default"}
    streams = {"default": FakeStream("default"), "side": FakeStream("side")}

    def synchronize() -> None:
        if state["error"]:
            raise RuntimeError(state["error"])

    def set_stream(stream: FakeStream) -> None:
        state["stream"] = stream.name

    monkeypatch.setattr(conftest, "_cuda_broken_by", None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: streams[state["stream"]])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda: streams["default"])
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(conftest, "_cuda_usable", lambda: state["usable"])
    return conftest, state


def test_a_clean_test_passes_the_cuda_checks(fake_cuda):
    conftest, _ = fake_cuda
    assert conftest._check_cuda("t.py::clean") == []
    assert conftest._cuda_broken_by is None


def test_a_sticky_fault_is_pinned_on_the_test_that_launched_it(fake_cuda):
    conftest, state = fake_cuda
    state["error"] = "CUDA error: an illegal memory access was encountered\nmore"
    state["usable"] = False
    [problem] = conftest._check_cuda("t.py::faulty")
    assert "launched after its last synchronisation" in problem
    assert "an illegal memory access was encountered; it is sticky" in problem
    assert conftest._cuda_broken_by == (
        "t.py::faulty broke this process's CUDA context "
        "(CUDA error: an illegal memory access was encountered)"
    )


def test_a_passing_error_is_reported_without_breaking_the_process(fake_cuda):
    conftest, state = fake_cuda
    state["error"] = "CUDA error: out of memory"
    [problem] = conftest._check_cuda("t.py::oom")
    assert problem.endswith("CUDA error: out of memory")
    assert conftest._cuda_broken_by is None


def test_an_open_capture_and_a_changed_stream_are_reported(fake_cuda):
    conftest, state = fake_cuda
    state["stream"] = "side"
    assert conftest._check_cuda("t.py::stream") == ["the current CUDA stream was left at side"]
    assert state["stream"] == "default"
    assert conftest._cuda_broken_by is None
    state["capturing"] = True
    assert conftest._check_cuda("t.py::capture") == [
        "a CUDA graph capture was left open on the current stream"
    ]
    assert conftest._cuda_broken_by == "t.py::capture left a CUDA graph capture open"


def test_a_changed_memory_fraction_or_sync_debug_mode_is_reported_and_put_back(monkeypatch):
    from tests import conftest

    settings = {"fraction": 0.25, "mode": 2}
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda: settings["fraction"])
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: settings["mode"])
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f: settings.update(fraction=f))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: settings.update(mode=m))
    assert conftest._restore_cuda_settings((1.0, 0)) == [
        "the per-process CUDA memory fraction 1.0 -> 0.25",
        "the CUDA sync debug mode 0 -> 2",
    ]
    assert settings == {"fraction": 1.0, "mode": 0}
    assert conftest._restore_cuda_settings((1.0, 0)) == []


# A child pytest run whose "GPU" is scripted: test_faults leaves an asynchronous fault behind
# (as a kernel past a tensor's end would: its own body passes), which the next synchronise
# reports and which stays (sticky) for the rest of that process.
SCRIPTED_GPU_CONFTEST = """
import pytest, torch
from tests import conftest
from tests.conftest import _isolated, pytest_runtest_protocol  # noqa: F401

FAULT = []

def synchronize():
    if FAULT:
        raise RuntimeError("CUDA error: device-side assert triggered")

conftest._cuda_in_use = lambda: True
conftest._cuda_usable = lambda: not FAULT
conftest._cuda_settings = lambda: (1.0, 0)
torch.cuda.synchronize = synchronize
torch.cuda.is_current_stream_capturing = lambda: False
torch.cuda.memory_allocated = lambda device=None: 0
torch.cuda.empty_cache = lambda: None
torch.cuda.current_stream = torch.cuda.default_stream = lambda device=None: "default"

def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: scripted")
"""

SCRIPTED_GPU_TESTS = """
import pytest
from conftest import FAULT

@pytest.mark.gpu
def test_faults():
    FAULT.append(1)

@pytest.mark.gpu
def test_after():
    pass

def test_cpu_only():
    pass
"""


def run_scripted_gpu(tmp_path: Path, *args: str) -> str:
    return run_child_pytest(tmp_path, SCRIPTED_GPU_CONFTEST, SCRIPTED_GPU_TESTS, *args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run below scripts a CPU-only torch")
def test_a_sticky_fault_fails_its_test_and_the_gpu_tests_after_it_by_its_name(tmp_path):
    out = run_scripted_gpu(tmp_path)
    assert "ERROR at teardown of test_faults" in out, out
    assert "device-side assert triggered; it is sticky" in out, out
    assert "ERROR at setup of test_after" in out, out
    assert (
        "not run: test_scripted.py::test_faults broke this process's CUDA context "
        "(CUDA error: device-side assert triggered)"
    ) in out, out
    assert "PASSED test_scripted.py::test_cpu_only" in out, out
    assert "2 passed, 2 errors" in out, out  # test_faults' teardown and test_after's setup


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run below scripts a CPU-only torch")
def test_under_xdist_a_sticky_fault_ends_the_worker_and_the_rest_run_in_a_fresh_one(tmp_path):
    pytest.importorskip("xdist")
    out = run_scripted_gpu(tmp_path, "-n", "1")
    assert "test_faults broke this process's CUDA context" in out, out
    assert "worker 'gw0' crashed while running 'test_scripted.py::test_faults'" in out, out
    assert "PASSED test_scripted.py::test_after" in out, out
    assert "PASSED test_scripted.py::test_cpu_only" in out, out
    # test_faults: its body passed, its teardown errored, then the worker's exit failed it.
    assert "1 failed, 3 passed, 1 error" in out, out


REAL_GPU_CONFTEST = """
from tests.conftest import _isolated, pytest_runtest_protocol  # noqa: F401

def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA")
"""

REAL_GPU_TESTS = """
import pytest, torch

@pytest.mark.gpu
def test_faults():
    x = torch.zeros(4, device="cuda")
    x[torch.tensor([10], device="cuda")] += 1  # past the end: a device-side assert, later

@pytest.mark.gpu
def test_after():
    assert torch.ones(1, device="cuda").item() == 1.0
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_device_side_assert_is_pinned_on_its_test(tmp_path):
    """On the GPU, in a child process (the fault is sticky there): the assert fires after
    test_faults' body returned, and the conftest names it, not test_after."""
    out = run_child_pytest(tmp_path, REAL_GPU_CONFTEST, REAL_GPU_TESTS)
    assert "ERROR at teardown of test_faults" in out, out
    assert "device-side assert triggered; it is sticky" in out, out
    assert "ERROR at setup of test_after" in out, out
    assert "not run: test_scripted.py::test_faults broke this process's CUDA context" in out, out
