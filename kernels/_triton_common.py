"""Launcher helpers that need triton (the attention kernel files import this)."""

from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels._common import dot_precision

__all__ = ["dot_args"]

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_args(kernel: object, dtype: torch.dtype) -> dict[str, object]:
    """The ``DOT_DTYPE`` and ``DOT_PRECISION`` constexprs of an attention kernel.

    Kernels cast both ``tl.dot`` operands to ``DOT_DTYPE`` (a no-op when it is the cache
    dtype). It differs only under the interpreter with bf16: Triton 3.x's interpreter
    multiplies bf16 operands as their raw uint16 bits (numpy has no bf16) and returns
    garbage. Upcasting to fp32 is exact (bf16 x bf16 products are exact in fp32, as in bf16
    tensor cores), so the interpreter still checks what the GPU computes. ``triton.jit``
    picks interpreter or compiler when the kernel is defined, so ask the kernel object.
    """
    if isinstance(kernel, InterpretedFunction) and dtype == torch.bfloat16:
        return {"DOT_DTYPE": tl.float32, "DOT_PRECISION": "ieee"}
    return {"DOT_DTYPE": _TL_DTYPES[dtype], "DOT_PRECISION": dot_precision(dtype)}
