"""Where a Triton test can run: on CPU tensors under the interpreter (``TRITON_INTERPRET=1``,
which tests/conftest.py sets on a machine without CUDA), or on CUDA with compiled kernels.
Each device skips where it cannot run; the CUDA one also carries the ``gpu`` mark."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "", "false", "False")

ON_INTERPRETED_CPU = pytest.mark.skipif(
    not INTERPRET, reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (set without CUDA)"
)
ON_COMPILED_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or INTERPRET,
        reason="needs CUDA and compiled (not interpreted) Triton",
    ),
]

# For ``@pytest.mark.parametrize("device", TRITON_DEVICES)``.
TRITON_DEVICES = [
    pytest.param("cpu", marks=ON_INTERPRETED_CPU),
    pytest.param("cuda", marks=ON_COMPILED_CUDA),
]
