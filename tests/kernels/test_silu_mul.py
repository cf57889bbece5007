"""Triton ``silu_mul`` vs ``kernels.reference.silu_mul``, and the twin vs the engine's
``SiluAndMul``.

CPU: under TRITON_INTERPRET=1 (set by conftest.py before this import). CUDA: compiled.
Tolerance: the kernel's exp is not torch's (compiled Triton uses the fast ex2), so silu may
differ in its last float32 bit: float32 within 2e-6 relative; fp16/bf16 within two ulps of
the dtype, relative to the output (silu is rounded to the dtype before the product, as torch
does; a last-bit difference can flip that rounding by one ulp of silu, which the product
carries, and then the product's own rounding by one more).
"""

from __future__ import annotations

import pytest
import torch

from engine.llama import SiluAndMul
from kernels import reference
from kernels.silu_mul import BLOCK, silu_mul
from tests.kernels.sm90_builds import builds_of

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_act_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=2e-6)
    else:
        ulp = torch.finfo(actual.dtype).eps
        torch.testing.assert_close(actual.float(), expected.float(), atol=ulp * 1e-2, rtol=2 * ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate_size", [64, 1536, BLOCK + 3])  # 1536: SmolLM2
def test_matches_reference(device, dtype, intermediate_size):
    gate_up = (4 * torch.randn(6, 2 * intermediate_size, device=device)).to(dtype)
    assert_act_close(silu_mul(gate_up), reference.silu_mul(gate_up))


def test_strided_rows_and_empty_batch(device):
    gate_up = torch.randn(8, 2 * 96, device=device)[::2]
    assert_act_close(silu_mul(gate_up), reference.silu_mul(gate_up.contiguous()))
    assert silu_mul(torch.empty(0, 2 * 96, device=device)).shape == (0, 96)


def test_rejects_odd_width(device):
    with pytest.raises(AssertionError):
        silu_mul(torch.randn(2, 7, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_engine_op(dtype):
    gate_up = torch.randn(3, 2 * 40).to(dtype)
    assert torch.equal(reference.silu_mul(gate_up), SiluAndMul()(gate_up))


@pytest.mark.parametrize("build", builds_of("silu_mul"))
def test_compiles_for_sm90(sm90_build_errors, build):
    """The compiled (non-interpreted) kernel builds for an H100, even on a CPU-only machine."""
    assert sm90_build_errors[build] is None, sm90_build_errors[build]
