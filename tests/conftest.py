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
