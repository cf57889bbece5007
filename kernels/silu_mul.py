"""Triton SiLU-times-up on the fused gate/up projection's output.

Import the launcher explicitly (``kernels/__init__.py`` never imports triton)::

    from kernels.silu_mul import silu_mul

Same signature and semantics as ``kernels.reference.silu_mul``, which is the engine's
``SiluAndMul`` (engine/llama.py): ``gate_up = [gate | up]`` along the last dimension, and
``out = silu(gate) * up`` with torch's rounding in a half dtype (``silu`` computed in
float32 and rounded to the dtype, then the product rounded again).

Grid ``(num_tokens, cdiv(intermediate_size, BLOCK))``: each program reads ``BLOCK`` gate and
``BLOCK`` up values of one row and writes ``BLOCK`` outputs, so every byte is read or written
once. One launch replaces the two chunks' ``silu`` and ``mul``; the grid comes from shapes
only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import SUPPORTED_DTYPES
from kernels._triton_common import pdl_args, pdl_enter, round_args, round_to

__all__ = ["silu_mul"]

BLOCK = 1024  # outputs per program


@triton.jit
def _silu_mul_kernel(
    out_ptr,  # [num_tokens, intermediate_size] contiguous
    gate_up_ptr,  # [num_tokens, 2 * intermediate_size]
    stride_gate_up_token: tl.int64,
    INTERMEDIATE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    DTYPE: tl.constexpr,
    SOFT_BF16_ROUND: tl.constexpr,  # see kernels/_triton_common.round_args
    PDL: tl.constexpr,  # a programmatic dependent launch (kernels/_triton_common.pdl_enter)
):
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE_SIZE
    row = gate_up_ptr + token * stride_gate_up_token
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + INTERMEDIATE_SIZE + offs, mask=mask, other=0.0).to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), DTYPE, SOFT_BF16_ROUND)
    tl.store(out_ptr + token * INTERMEDIATE_SIZE + offs, (silu * up).to(DTYPE), mask=mask)


def silu_mul(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate_size]
    *,
    pdl: bool | None = None,  # a programmatic dependent launch; None: PAGEDSERVE_PDL's
) -> torch.Tensor:  # [num_tokens, intermediate_size]
    """``silu(gate) * up`` of ``gate_up = [gate | up]``; rows may be strided, not columns."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, tuple(gate_up.shape)
    assert gate_up.dtype in SUPPORTED_DTYPES, gate_up.dtype
    assert gate_up.stride(1) == 1, "rows of gate_up must be contiguous"
    num_tokens, width = gate_up.shape
    intermediate_size = width // 2
    out = torch.empty((num_tokens, intermediate_size), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or intermediate_size == 0:
        return out
    grid = (num_tokens, triton.cdiv(intermediate_size, BLOCK))
    _silu_mul_kernel[grid](
        out, gate_up, gate_up.stride(0),
        INTERMEDIATE_SIZE=intermediate_size, BLOCK=BLOCK,
        **round_args(_silu_mul_kernel, gate_up.dtype),
        **pdl_args(pdl, gate_up.device),
    )  # fmt: skip
    return out
