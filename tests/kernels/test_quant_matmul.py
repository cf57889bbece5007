"""Triton ``quant_matmul`` vs ``kernels.reference.quant_matmul``, and the reference vs the
float matmul with the de-quantized weight.

CPU: under TRITON_INTERPRET=1 (conftest.py). CUDA: compiled. Tolerance: both sum in float32
and scale each column once, in different orders: float32 within ``TOLERANCES`` of the
kernel tests; bf16/fp16 outputs within one ulp of the dtype at the output's magnitude (both
round a float32 sum once). The reference against ``x @ (q * scale)`` in float64: 1e-6 of
``|x| @ |W|`` (float32 summation error).
"""

from __future__ import annotations

import pytest
import torch

from engine.quantization import dequantize_weight, quantize_weight
from kernels import reference
from kernels.quant_matmul import LIBRARY_ROWS, quant_matmul

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = ["int8", "fp8"]


def _case(rows: int, k: int, n: int, dtype: torch.dtype, mode: str, device, bias: bool):
    g = torch.Generator().manual_seed(rows * 7 + k + n)
    w = torch.randn(k, n, generator=g) * torch.rand(n, generator=g)
    q, scale = quantize_weight(w, mode)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(x), move(q), move(scale), move(b)


def assert_matches(got: torch.Tensor, want: torch.Tensor, close) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        close(got, want)
    else:
        ulp = torch.finfo(got.dtype).eps
        torch.testing.assert_close(
            got.float(), want.float(), atol=ulp * want.float().abs().max().item(), rtol=ulp
        )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n", [(1, 96, 200), (5, 64, 64), (33, 160, 70)])
def test_matches_reference(device, close, mode, dtype, rows, k, n):
    x, q, scale, b = _case(rows, k, n, dtype, mode, device, bias=rows == 5)
    assert_matches(quant_matmul(x, q, scale, b), reference.quant_matmul(x, q, scale, b), close)


def test_strided_rows_and_empty_batch(device, close):
    x, q, scale, _ = _case(8, 64, 48, torch.float32, "int8", device, bias=False)
    got = quant_matmul(x[::2], q, scale)
    close(got, reference.quant_matmul(x[::2].contiguous(), q, scale))
    assert quant_matmul(x[:0], q, scale).shape == (0, 48)


def test_large_batches_take_the_library(close):
    """Past ``LIBRARY_ROWS`` rows the launcher multiplies with torch's matmul (CPU tensors
    here; no Triton launch), the same product."""
    x, q, scale, b = _case(LIBRARY_ROWS + 3, 64, 48, torch.float32, "int8", "cpu", bias=True)
    close(quant_matmul(x, q, scale, b), reference.quant_matmul(x, q, scale, b))


@pytest.mark.parametrize("mode", MODES)
def test_reference_is_the_dequantized_product(mode):
    x, q, scale, b = _case(4, 1536, 576, torch.float32, mode, "cpu", bias=True)
    w = dequantize_weight(q, scale).double()
    want = x.double() @ w + b.double()
    bound = x.double().abs() @ w.abs() + b.double().abs()
    err = ((reference.quant_matmul(x, q, scale, b).double() - want).abs() / bound).max()
    assert err <= 1e-6, err


def test_rejects_bad_input(device):
    x, q, scale, _ = _case(2, 64, 48, torch.float32, "int8", device, bias=False)
    with pytest.raises(AssertionError):
        quant_matmul(x, q.float(), scale)  # not a quantized weight
    with pytest.raises(AssertionError):
        quant_matmul(x[:, :32], q, scale)  # inner sizes differ


@pytest.mark.parametrize("build", ["quant_matmul_int8", "quant_matmul_fp8"])
def test_compiles_for_sm90(sm90_build_errors, build):
    """The compiled (non-interpreted) kernel builds for an H100, even on a CPU-only machine."""
    assert sm90_build_errors[build] is None, sm90_build_errors[build]
