"""Triton ``rms_norm`` / ``add_rms_norm_`` vs their twins in ``kernels.reference``, and the
twins vs the engine's own ``RMSNorm`` and ``RMSNorm.add_norm_``.

CPU: under TRITON_INTERPRET=1 (set by conftest.py before this import). CUDA: compiled.
Tolerance: the residual stream is compared bit for bit (one rounded add). The normed output
may differ from torch by the order of the float32 sum of squares and by rsqrt's last bit:
float32 within 2e-6 relative; fp16/bf16 within two ulps of the dtype, relative to the output
(the row is rounded to the dtype before the weight, so a last-bit difference in fp32 can
flip that rounding by one ulp, which the weight's product carries, then its own by one).
"""

from __future__ import annotations

import pytest
import torch

from engine.llama import RMSNorm
from kernels import reference
from kernels.rms_norm import add_rms_norm_, rms_norm
from tests.kernels.sm90_builds import builds_of

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5


def assert_norm_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=2e-6)
    else:
        ulp = torch.finfo(actual.dtype).eps  # one ulp at 1.0; values are O(1)
        torch.testing.assert_close(actual.float(), expected.float(), atol=ulp * 1e-2, rtol=2 * ulp)


def inputs(num_tokens, hidden_size, dtype, device):
    x = torch.randn(num_tokens, hidden_size, device=device).to(dtype)
    residual = (3 * torch.randn(num_tokens, hidden_size, device=device)).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden_size, device=device)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [64, 576, 4096])  # 576: SmolLM2, not a power of two
def test_add_rms_norm_matches_reference(device, dtype, hidden_size):
    x, residual, weight = inputs(7, hidden_size, dtype, device)
    ref_residual = residual.clone()
    out = add_rms_norm_(x, residual, weight, EPS)
    expected = reference.add_rms_norm_(x, ref_residual, weight, EPS)
    assert torch.equal(residual, ref_residual)  # the stream: one rounded add, bit for bit
    assert_norm_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [64, 576])
def test_rms_norm_matches_reference(device, dtype, hidden_size):
    x, _, weight = inputs(5, hidden_size, dtype, device)
    before = x.clone()
    assert_norm_close(rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))
    assert torch.equal(x, before)  # no residual, nothing written to x


@pytest.mark.parametrize("num_warps", [4, 16])
def test_other_warps_give_the_same_bits(device, num_warps):
    """The launches ``benchmarks.kernels --fused`` times beside the default (8 warps for a
    row of 4,096): one program still owns one row, so the bits are the default's."""
    x, residual, weight = inputs(3, 4096, torch.bfloat16, device)
    default_residual = residual.clone()
    default = add_rms_norm_(x, default_residual, weight, EPS)
    out = add_rms_norm_(x, residual, weight, EPS, num_warps=num_warps)
    assert torch.equal(out, default) and torch.equal(residual, default_residual)
    assert torch.equal(rms_norm(x, weight, EPS, num_warps=num_warps), rms_norm(x, weight, EPS))


def test_strided_rows_and_empty_batch(device):
    """x as every other row of a larger tensor; zero tokens launch nothing."""
    big = torch.randn(10, 128, device=device)
    x = big[::2]
    residual = torch.randn(5, 128, device=device)
    weight = torch.randn(128, device=device)
    ref_residual = residual.clone()
    out = add_rms_norm_(x, residual, weight, EPS)
    assert_norm_close(out, reference.add_rms_norm_(x.contiguous(), ref_residual, weight, EPS))
    assert torch.equal(residual, ref_residual)
    empty = torch.empty(0, 128, device=device)
    assert rms_norm(empty, weight, EPS).shape == (0, 128)


def test_rejects_mismatched_weight(device):
    x = torch.randn(2, 64, device=device)
    with pytest.raises(AssertionError):
        rms_norm(x, torch.ones(32, device=device), EPS)
    with pytest.raises(AssertionError):  # weight in another dtype than x
        rms_norm(x, torch.ones(64, dtype=torch.bfloat16, device=device), EPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_engine_norm(dtype):
    """The twin computes what the engine's RMSNorm and RMSNorm.add_norm_ compute, bit for bit."""
    x, residual, weight = inputs(4, 96, dtype, torch.device("cpu"))
    norm = RMSNorm(96, EPS).to(dtype)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        assert torch.equal(reference.rms_norm(x, weight, EPS), norm(x))
        engine_residual, ref_residual = residual.clone(), residual.clone()
        engine_out = norm.add_norm_(x, engine_residual)
        ref_out = reference.add_rms_norm_(x, ref_residual, weight, EPS)
    assert torch.equal(ref_out, engine_out) and torch.equal(ref_residual, engine_residual)


@pytest.mark.parametrize("build", builds_of("rms_norm"))
def test_compiles_for_sm90(sm90_build_errors, build):
    """The compiled (non-interpreted) kernel builds for an H100, even on a CPU-only machine."""
    assert sm90_build_errors[build] is None, sm90_build_errors[build]
