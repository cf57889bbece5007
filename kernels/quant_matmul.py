"""Triton matmul against a per-output-channel quantized weight (int8, or fp8 e4m3 on CUDA).

Import the launcher explicitly (``kernels/__init__.py`` never imports triton)::

    from kernels.quant_matmul import quant_matmul

Same signature and semantics as ``kernels.reference.quant_matmul``: ``y = x @ (weight *
scale) + bias`` with ``weight`` stored ``[in_features, out_features]`` (the model's
``Linear`` layout) in 1 byte a value. Weight-only quantization: the activations stay in the
model's dtype, each weight tile is converted to it in registers (exact: int8 and e4m3 values
are bf16/fp16/fp32 values), multiplied on the tensor cores with float32 accumulation, and
each output column is scaled once at the end. A decode step reads 1 byte a weight instead of
2 (bf16); its time is the weight bytes read, which is why decode does not quantize the
activations as ``torch._int_mm`` would (that needs ``M > 16`` and pays a per-token
quantization per matmul).

Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``; every program streams a ``BLOCK_N``-column
strip of the weight through K. Shapes and the grid come from the arguments only (CUDA-graph
safe). Large batches (prefill) use the library's matmul on the weight converted to the
activation dtype instead (``LIBRARY_ROWS``): this kernel is not tuned for compute-bound shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import SUPPORTED_DTYPES
from kernels._triton_common import TL_DTYPES, dot_args

__all__ = ["quant_matmul", "tile_shape", "LIBRARY_ROWS", "WEIGHT_DTYPES"]

WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)
# Batches of more rows multiply on the library (cuBLAS) path; decode batches and CUDA graphs
# stay within it.
LIBRARY_ROWS = 256


@triton.jit
def _quant_matmul_kernel(
    out_ptr,  # [M, N] contiguous, x's dtype
    x_ptr,  # [M, K], rows strided
    weight_ptr,  # [K, N] contiguous, int8, or uint8 holding float8e4nv bits (FP8)
    scale_ptr,  # [N] float32
    bias_ptr,  # [N] x's dtype (unused without HAS_BIAS)
    M,
    N,
    K,
    stride_x_m: tl.int64,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,  # the weight's bytes are e4m3 values (else int8)
    BLOCK_M: tl.constexpr,  # >= 16 (tl.dot minimum) and a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DTYPE: tl.constexpr,  # the activations' (and output's) dtype
    DOT_DTYPE: tl.constexpr,  # tl.dot operand type, see kernels/_triton_common.dot_args
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_x_m + k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            weight_ptr + k[:, None] * N + offs_n[None, :],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0,
        )
        if FP8:  # loaded as bytes: masked-off bytes are 0, which is e4m3's +0.0
            w = w.to(tl.float8e4nv, bitcast=True)
        # The weight's integer (or e4m3) values convert exactly to the dot's dtype.
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * N + offs_n[None, :],
        acc.to(DTYPE),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def tile_shape(rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for a batch of ``rows``. Decode batches (<= 16 rows) take
    narrow column strips so that a 4,096-column matmul is 128 programs, about one per SM of
    an H100 (64-wide strips would leave half of them idle while the weights stream), and
    long K steps. Not yet tuned on a GPU (benchmarks/RESULTS.md lists the run owed)."""
    if rows <= 16:
        return 16, 32, 128
    return (32 if rows <= 32 else 64), 64, 64


def quant_matmul(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [in_features, out_features] int8 or float8_e4m3fn, contiguous
    scale: torch.Tensor,  # [out_features] float32
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_tokens, out_features], x's dtype
    """``x @ (weight * scale) + bias``; rows of ``x`` may be strided, not columns."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[0], (
        tuple(x.shape),
        tuple(weight.shape),
    )
    assert x.dtype in SUPPORTED_DTYPES, x.dtype
    assert weight.dtype in WEIGHT_DTYPES and weight.is_contiguous(), weight.dtype
    assert scale.dtype == torch.float32 and scale.shape == (weight.shape[1],)
    assert bias is None or bias.shape == (weight.shape[1],)
    assert x.stride(1) == 1, "rows of x must be contiguous"
    m, k = x.shape
    n = weight.shape[1]
    if m > LIBRARY_ROWS:
        y = (x @ weight.to(x.dtype)).float() * scale
        return (y if bias is None else y + bias.float()).to(x.dtype)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k = tile_shape(m)
    fp8 = weight.dtype == torch.float8_e4m3fn
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](
        out, x, weight.view(torch.uint8) if fp8 else weight, scale,
        bias if bias is not None else scale, m, n, k, x.stride(0),
        HAS_BIAS=bias is not None, FP8=fp8, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DTYPE=TL_DTYPES[x.dtype], **dot_args(_quant_matmul_kernel, x.dtype),
    )  # fmt: skip
    return out
