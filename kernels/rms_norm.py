"""Triton RMSNorm, alone or fused with the residual add that precedes it.

Import the launchers explicitly (``kernels/__init__.py`` never imports triton)::

    from kernels.rms_norm import add_rms_norm_, rms_norm

Same signatures and semantics as ``kernels.reference.rms_norm`` / ``add_rms_norm_``, which
are the engine's ``RMSNorm.forward`` and ``RMSNorm.add_norm_``: the statistics in
float32 whatever the dtype, the normalised row cast back to the dtype *before* it is
multiplied by the weight (as transformers' ``LlamaRMSNorm`` does)::

    residual = residual + x                       # in place, in the residual's dtype
    out = weight * (r32 * rsqrt(mean(r32**2) + eps)).to(dtype)     # r32 = residual.float()

Grid ``(num_tokens,)``: a program owns one whole row (the mean needs all of it), loaded once
into registers; ``hidden_size`` is padded to a power of two and masked. One launch replaces
the residual add, ``pow``, ``mean``, ``rsqrt``, two multiplies and the dtype copies around
them. Nothing is read on the host: the grid is the row count (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import SUPPORTED_DTYPES
from kernels._triton_common import pdl_args, pdl_enter, round_args, round_to
from kernels.settings import next_power_of_2

__all__ = ["add_rms_norm_", "choose_num_warps", "rms_norm"]


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_tokens, hidden_size] contiguous
    x_ptr,  # [num_tokens, hidden_size]
    residual_ptr,  # [num_tokens, hidden_size], updated in place (HAS_RESIDUAL only)
    weight_ptr,  # [hidden_size]
    eps,
    stride_x_token: tl.int64,
    stride_residual_token: tl.int64,
    HIDDEN_SIZE: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,  # next power of two of HIDDEN_SIZE
    HAS_RESIDUAL: tl.constexpr,
    DTYPE: tl.constexpr,
    SOFT_BF16_ROUND: tl.constexpr,  # see kernels/_triton_common.round_args
    PDL: tl.constexpr,  # a programmatic dependent launch (kernels/_triton_common.pdl_enter)
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HIDDEN_PAD)
    mask = offs < HIDDEN_SIZE
    # The weight first: no kernel of a step writes it, so it may load before pdl_enter (as a
    # dependent launch, while the kernel before still runs). Loaded after the residual's
    # store, as it was, it could not be issued before that store completed (the pointers
    # may alias), a third round trip to memory in a launch that is mostly latency.
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    x = tl.load(x_ptr + token * stride_x_token + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = residual_ptr + token * stride_residual_token + offs
        r = tl.load(residual, mask=mask, other=0.0).to(tl.float32)
        # The stream is stored in its dtype; the norm reads back what was stored.
        x = round_to(r + x, DTYPE, SOFT_BF16_ROUND)
        tl.store(residual, x.to(DTYPE), mask=mask)
    mean_square = tl.sum(x * x, axis=0) / HIDDEN_SIZE
    normed = round_to(x * tl.rsqrt(mean_square + eps), DTYPE, SOFT_BF16_ROUND)
    tl.store(out_ptr + token * HIDDEN_SIZE + offs, (normed * w).to(DTYPE), mask=mask)


def choose_num_warps(hidden_size: int) -> int:
    """The warps of a launch over rows of ``hidden_size``: a row of 4,096 is 16 values a
    thread at 8 warps; wider rows get more warps (at most 16), narrower ones at least 4."""
    return min(16, max(4, next_power_of_2(hidden_size) // 512))


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    num_warps: int | None,
    pdl: bool | None,
) -> torch.Tensor:
    assert x.dim() == 2, f"x must be [num_tokens, hidden_size], got {tuple(x.shape)}"
    num_tokens, hidden_size = x.shape
    assert x.dtype in SUPPORTED_DTYPES, x.dtype
    assert weight.shape == (hidden_size,), (weight.shape, x.shape)
    assert weight.dtype == x.dtype, (weight.dtype, x.dtype)
    assert weight.is_contiguous() and x.stride(1) == 1, "rows must be contiguous"
    assert x.device == weight.device
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual, x)
        assert residual.stride(1) == 1 and residual.device == x.device
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    hidden_pad = next_power_of_2(hidden_size)
    if num_warps is None:
        num_warps = choose_num_warps(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        out, x, x if residual is None else residual, weight, eps,
        x.stride(0), 0 if residual is None else residual.stride(0),
        HIDDEN_SIZE=hidden_size, HIDDEN_PAD=hidden_pad, HAS_RESIDUAL=residual is not None,
        num_warps=num_warps,
        **round_args(_rms_norm_kernel, x.dtype),
        **pdl_args(pdl, x.device),
    )  # fmt: skip
    return out


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size], x's dtype
    eps: float,
    *,
    num_warps: int | None = None,  # None: choose_num_warps
    pdl: bool | None = None,  # a programmatic dependent launch; None: PAGEDSERVE_PDL's
) -> torch.Tensor:  # [num_tokens, hidden_size]
    """``weight * rms_normalised(x)``, statistics in float32, cast to the dtype before the
    weight. ``x`` may be a strided view with contiguous rows."""
    return _launch(x, None, weight, eps, num_warps, pdl)


def add_rms_norm_(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    residual: torch.Tensor,  # [num_tokens, hidden_size], updated in place
    weight: torch.Tensor,  # [hidden_size], x's dtype
    eps: float,
    *,
    num_warps: int | None = None,  # None: choose_num_warps
    pdl: bool | None = None,  # a programmatic dependent launch; None: PAGEDSERVE_PDL's
) -> torch.Tensor:  # [num_tokens, hidden_size]
    """``residual += x`` in place (rounded to its dtype), then ``rms_norm(residual)``."""
    return _launch(x, residual, weight, eps, num_warps, pdl)
