"""Suite-wide set-up.

Without CUDA the Triton kernels run under Triton's interpreter. Triton decides
interpreter-or-compiler when a ``@triton.jit`` function is defined (when ``kernels.<name>``
is first imported), so the switch is set here, before any test module imports a kernel.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
