"""The C++ matmul on per-output-channel int8 weights (``pack_int8``, kernels/cpu/csrc/gemm_q.cpp).

``--quantization int8`` (engine/quantization.py) packs each matmul's int8 values and float32
scales as Q8 panels, so the Q8 matmul (integer dot products with VNNI, de-quantized in
registers on AVX2 and AVX-512) multiplies by them. The checks:

- the panels de-quantize to ``float(q) * scale`` bit for bit, the float32 weight the loader
  compares them with (engine/backends/cpu.py ``_int8_blocks``);
- ``quant_linear`` on them matches a float64 product with the same weights within
  ``1e-6 * (|x| @ |W| + |bias|)``, a bound on float32 summation error (2^-24 per add, K <= 1,536
  terms, ~9e-5 in the worst case, ~1e-6 in practice as errors average out) plus, on the
  integer path, x rounded to 22 bits below its 32-block's largest element (2^-22 relative).
  The measured worst case here: 4.4e-7 of that scale (AVX-512 VNNI build), 2e-7 (AVX2 build).

Runs again for the AVX2 and the AVX-512-without-VNNI builds in tests/kernels/test_other_targets.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.quantization import dequantize_weight, quantize_weight

# (K, N): ragged last panel, one 32-block, the default model's q/k/v and down shapes.
SHAPES = [(96, 200), (32, 1287), (576, 960), (1536, 576)]
TOLERANCE = 1e-6  # of |x| @ |W| (module docstring)


def _weights(k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(k, n, generator=g) * torch.rand(n, generator=g)  # scales differ by column
    w[:, 0] = 0  # an all-zero column (scale 1)
    return quantize_weight(w, "int8")


def assert_close_to_product(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> None:
    want = x.double() @ w.double()
    scale = x.double().abs() @ w.double().abs() + 1e-30
    if bias is not None:
        want += bias.double()
        scale += bias.double().abs()
    err = ((got.double() - want).abs() / scale).max().item()
    assert err <= TOLERANCE, f"error {err:.2e} of |x| @ |W|, allowed {TOLERANCE}"


@pytest.mark.parametrize("k,n", SHAPES)
def test_pack_int8_dequantizes_to_q_times_scale_bitwise(ops, k, n):
    q, scale = _weights(k, n, seed=k + n)
    panels = ops.pack_int8(q, scale)
    width = ops.quant_panel_width(8)  # the Q8 panels' (gemm.h NBQ)
    assert panels.dtype == torch.uint8 and panels.shape[:2] == ((n + width - 1) // width, k // 32)
    got = ops.dequantize_panels(panels, n)
    want = dequantize_weight(q, scale)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_quant_linear_on_int8_panels_matches_the_product(ops, k, n, bias):
    q, scale = _weights(k, n, seed=3 * k + n)
    panels = ops.pack_int8(q, scale)
    w = dequantize_weight(q, scale)
    g = torch.Generator().manual_seed(k * n)
    b = torch.randn(n, generator=g) if bias else None
    limit = ops.max_quant_rows()
    for rows in sorted({1, 2, 3, 5, 7, 13, limit}):
        x = torch.randn(rows, k, generator=g)
        got = ops.quant_linear(x, panels, n, b)
        assert got.shape == (rows, n) and got.is_contiguous()
        assert_close_to_product(got, x, w, b)
        # The engine's path: linear() picks the int8 panels for up to max_quant_rows() rows.
        if rows <= limit:
            assert torch.equal(ops.linear(x, w, ops.pack_weight(w), panels, b), got)


def test_pack_int8_takes_non_contiguous_input(ops):
    q, scale = _weights(64, 48, seed=1)
    qt = q.t().contiguous().t()  # same values, column-major
    assert not qt.is_contiguous()
    assert torch.equal(ops.pack_int8(qt, scale), ops.pack_int8(q, scale))


def test_pack_int8_rejects_bad_input(ops):
    q, scale = _weights(64, 48, seed=2)
    with pytest.raises(RuntimeError, match="int8"):
        ops.pack_int8(q.float(), scale)
    with pytest.raises(RuntimeError, match="float32"):
        ops.pack_int8(q, scale[:-1])
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.pack_int8(q[:48], scale)
