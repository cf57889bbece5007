"""Process-wide state that every test must leave as it found it (checked by tests/conftest.py).

pytest runs many tests in one process (under ``pytest -n``, many in each worker, in an order
the scheduler picks), so a test that changes process-wide state changes every test after it
in that process: the failure then shows up in an unrelated test, in whichever worker drew
both. After each test the suite compares this state with what it was before the test, puts
back whatever changed, and fails the test that changed it.

What is checked, and why each matters here:

- ``TRITON_INTERPRET``: Triton reads it when a ``@triton.jit`` function is defined, so a test
  that sets it changes nothing for kernels already imported, but every kernel module imported
  after it runs interpreted (or compiled) against the ``device`` fixture's expectation.
- torch's default dtype and default device: every ``torch.randn``/``torch.zeros`` of a later
  test would build another dtype or device than it names nowhere.
- grad mode: a later test's engine or reference would record autograd graphs (memory) or, the
  other way round, a training-style check would silently see no gradients.
- the globals of the Triton kernel modules (``kernels.*``): tests swap launch tables and
  device queries with ``monkeypatch``, which restores them; a plain assignment would not.

The CUDA side (an asynchronous fault, a stream left capturing, a changed current stream, the
allocator's memory fraction, the sync debug mode) is checked in tests/conftest.py.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

__all__ = ["ProcessState", "restore", "snapshot"]

# Modules whose globals are checked: the kernels package, where the GPU tests' launch tables,
# device queries and kernel objects live. Names bound after the snapshot (a submodule imported
# during the test) are not changes.
KERNEL_MODULE_PREFIX = "kernels"
_UNSET = object()


@dataclass(frozen=True)
class ProcessState:
    triton_interpret: str | None
    default_dtype: torch.dtype
    default_device: torch.device
    grad_enabled: bool
    kernel_globals: dict[tuple[str, str], Any]  # (module, name) -> the bound object


def _kernel_modules() -> list[tuple[str, ModuleType]]:
    return [
        (name, module)
        # A copy made in one C call: a thread left by an earlier test may import meanwhile,
        # and iterating the live dict then raises ("dictionary changed size").
        for name, module in sys.modules.copy().items()
        if module is not None
        and (name == KERNEL_MODULE_PREFIX or name.startswith(KERNEL_MODULE_PREFIX + "."))
    ]


def snapshot() -> ProcessState:
    return ProcessState(
        triton_interpret=os.environ.get("TRITON_INTERPRET"),
        default_dtype=torch.get_default_dtype(),
        default_device=torch.get_default_device(),
        grad_enabled=torch.is_grad_enabled(),
        kernel_globals={
            (name, attr): value
            for name, module in _kernel_modules()
            for attr, value in vars(module).items()
            if not (attr.startswith("__") and attr.endswith("__"))
        },
    )


def restore(before: ProcessState) -> list[str]:
    """Put back whatever differs from ``before``; one line per change, empty if none."""
    changes: list[str] = []
    interpret = os.environ.get("TRITON_INTERPRET")
    if interpret != before.triton_interpret:
        changes.append(f"TRITON_INTERPRET {before.triton_interpret!r} -> {interpret!r}")
        if before.triton_interpret is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before.triton_interpret
    dtype = torch.get_default_dtype()
    if dtype != before.default_dtype:
        changes.append(f"torch default dtype {before.default_dtype} -> {dtype}")
        torch.set_default_dtype(before.default_dtype)
    device = torch.get_default_device()
    if device != before.default_device:
        changes.append(f"torch default device {before.default_device} -> {device}")
        # None, not "cpu": no device mode left installed for every factory call after.
        cpu = before.default_device == torch.device("cpu")
        torch.set_default_device(None if cpu else before.default_device)
    if torch.is_grad_enabled() != before.grad_enabled:
        changes.append(f"grad mode {before.grad_enabled} -> {torch.is_grad_enabled()}")
        torch.set_grad_enabled(before.grad_enabled)
    for (name, attr), value in before.kernel_globals.items():
        module = sys.modules.get(name)
        now = _UNSET if module is None else vars(module).get(attr, _UNSET)
        if module is not None and now is not value:
            changes.append(f"{name}.{attr} rebound (monkeypatch restores what it sets)")
            setattr(module, attr, value)
    return changes
