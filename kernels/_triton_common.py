"""Launcher and device helpers that need triton (the kernel files import this)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels._common import dot_precision

__all__ = ["TL_DTYPES", "dot_args", "round_args", "round_to"]

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


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
    return {"DOT_DTYPE": TL_DTYPES[dtype], "DOT_PRECISION": dot_precision(dtype)}


def round_args(kernel: object, dtype: torch.dtype) -> dict[str, object]:
    """The ``DTYPE`` and ``SOFT_BF16_ROUND`` constexprs of a kernel that calls ``round_to``.

    Triton 3.x's interpreter converts fp32 to bf16 by truncation, compiled code (and torch)
    round to nearest even. Kernels whose every intermediate rounding must match torch's
    op-by-op rounding then round in software under the interpreter, so that CPU tests can
    compare them bit for bit; compiled kernels use the hardware conversion.
    """
    soft = isinstance(kernel, InterpretedFunction) and dtype == torch.bfloat16
    return {"DTYPE": TL_DTYPES[dtype], "SOFT_BF16_ROUND": soft}


@triton.jit
def round_to(x, DTYPE: tl.constexpr, SOFT_BF16_ROUND: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (nearest even, as torch's ``.to()``), returned as fp32.

    What a torch elementwise op in a half dtype stores: it computes in fp32 and rounds once.
    A value returned here converts to ``DTYPE`` exactly, so a later store's cast (even the
    interpreter's truncating one) does not round again. NaN and inf are not handled in the
    software path (interpreter only).
    """
    if SOFT_BF16_ROUND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)
