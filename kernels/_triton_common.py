"""``@triton.jit`` helpers shared by the attention kernels (imports triton; launchers only)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["dot", "is_interpreted"]


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was built under ``TRITON_INTERPRET=1`` (runs as numpy on CPU).

    ``triton.jit`` takes that decision once, when the kernel's module is imported, so ask
    the kernel object rather than re-reading the environment.
    """
    return isinstance(kernel, InterpretedFunction)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot(a, b)`` with an fp32 accumulator.

    ``UPCAST`` exists for the interpreter only: Triton 3.x's interpreter multiplies bf16
    operands as their raw uint16 bits (numpy has no bf16), giving garbage. Upcasting to fp32
    first is exact (a bf16 value is an fp32 value, and bf16 x bf16 products are exact in
    fp32), so the result matches what bf16 tensor cores compute. On a GPU it stays False.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)
