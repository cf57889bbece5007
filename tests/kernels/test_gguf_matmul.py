"""The C++ matmul on GGUF blocks (``kernels/cpu/csrc/gemm_q.cpp``) against gguf-py.

gguf-py's de-quantizer is what ``transformers`` loads a GGUF checkpoint with, so it is the
oracle: packed blocks must de-quantize to exactly its float32 values, and ``quant_linear``
must multiply by them (up to summation order, and with integer dot products x's rounding to
22 bits below its 32-block's largest element: gemm_q.cpp). ``linear`` must pick the blocks
for 1 to ``max_quant_rows()`` rows (64 with AVX-512 VNNI, 12 with AVX-512, 8 with AVX2),
the float32 panels up to ``max_packed_rows()`` (256) and the library above.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
ROW_BYTES_PER_BLOCK = {2: 18, 3: 20, 8: 34}  # bytes of one 32-weight block
# (N, K): ragged last panel (200 = 3 * 64 + 8), exact panels, one block of K with many
# panels (odd count: the one-row path's lockstep pairs plus a leftover), the model's width.
SHAPES = [(200, 96), (128, 64), (1287, 32), (960, 576)]


def _blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """gguf-py's blocks for a random [n, k] float32 matrix: uint8 [n, k / 32 * block bytes]."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k), dtype=np.float32)
    raw = quantize(w, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (n, k // 32 * ROW_BYTES_PER_BLOCK[int(qtype)])
    return raw


def _dequantized(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The oracle, as the matmul's [K, N] weight."""
    return torch.from_numpy(dequantize(raw, qtype).astype(np.float32, copy=False)).t()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", SHAPES)
def test_dequantize_panels_matches_gguf_bitwise(ops, qtype, n, k):
    raw = _blocks(qtype, n, k, seed=n + k)
    panels = ops.pack_gguf(torch.from_numpy(raw), int(qtype), k)
    nb = ops.quant_panel_width(int(qtype))  # one vector where its matmul is integer (gemm.h)
    assert panels.dtype == torch.uint8 and panels.shape[:2] == ((n + nb - 1) // nb, k // 32)
    got = ops.dequantize_panels(panels, n)
    want = _dequantized(raw, qtype)
    assert got.dtype == torch.float32 and got.shape == (k, n)
    assert torch.equal(got, want), (got - want).abs().max()
    # Bit for bit, but for the sign of zero in Q4_0: gguf-py computes d * (q - 8), which is
    # -0.0 for q = 8 and d < 0; the kernel's d * q + (-8 d) is +0.0 there. Equal values, and
    # the same products (x * -0.0 and x * +0.0 differ only in the sign of a zero).
    same_bits = got.view(torch.int32) == want.view(torch.int32)
    if qtype == GGMLQuantizationType.Q4_0:
        same_bits |= want == 0
    assert same_bits.all(), got[~same_bits][:8]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_pack_gguf_takes_a_non_contiguous_view(ops, qtype):
    raw = _blocks(qtype, 140, 64, seed=7)
    wide = np.zeros((140, raw.shape[1] + 5), np.uint8)
    wide[:, 3 : 3 + raw.shape[1]] = raw
    view = torch.from_numpy(wide)[:, 3 : 3 + raw.shape[1]]
    assert not view.is_contiguous()
    got = ops.dequantize_panels(ops.pack_gguf(view, int(qtype), 64), 140)
    assert torch.equal(got, _dequantized(raw, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_quant_linear_matches_matmul(ops, qtype, n, k, bias):
    raw = _blocks(qtype, n, k, seed=3 * n + k)
    panels = ops.pack_gguf(torch.from_numpy(raw), int(qtype), k)
    w = _dequantized(raw, qtype)
    g = torch.Generator().manual_seed(n * k)
    b = torch.randn(n, generator=g) if bias else None
    for rows in (1, 2, 3, 5, 6, 7, 13, 24, 30):
        x = torch.randn(rows, k, generator=g)
        got = ops.quant_linear(x, panels, n, b)
        want = x @ w if b is None else torch.addmm(b, x, w)
        assert got.shape == (rows, n) and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{rows} rows")


@pytest.mark.parametrize("num_threads", [2, 3, 5])
@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0], ids=lambda t: t.name
)
@pytest.mark.parametrize("n,k", [(576, 576), (576, 1536), (960, 576), (64, 32), (200, 96)])
def test_one_row_over_threads_matches_matmul(ops, threads, num_threads, qtype, n, k):
    """One row over 2, 3 or 5 threads, whole panels each: shares that do not divide (9, 15
    panels), fewer panels than threads (1 panel, 4 panels on 5 threads), a ragged last panel."""
    threads(num_threads)
    raw = _blocks(qtype, n, k, seed=n + k)
    panels = ops.pack_gguf(torch.from_numpy(raw), int(qtype), k)
    w = _dequantized(raw, qtype)
    g = torch.Generator().manual_seed(n - k)
    x, b = torch.randn(1, k, generator=g), torch.randn(n, generator=g)
    for bias, want in ((b, torch.addmm(b, x, w)), (None, x @ w)):
        got = ops.quant_linear(x, panels, n, bias)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quant_linear_keeps_scale_and_non_finite_values(ops, qtype):
    """x's rows far from 1 in either direction, zero, or with an inf or NaN: the integer path
    scales each 32-block by its own power of two (gemm_q.cpp), so tiny and huge rows keep
    their relative precision, and a non-finite block makes its row's outputs non-finite (NaN
    on the integer path; inf or NaN on the float one), without touching the other rows."""
    n, k = 96, 128
    raw = _blocks(qtype, n, k, seed=17)
    panels = ops.pack_gguf(torch.from_numpy(raw), int(qtype), k)
    w = _dequantized(raw, qtype).double()
    g = torch.Generator().manual_seed(4)
    base = torch.randn(7, k, generator=g)
    scales = torch.tensor([1.0, 1e-30, 1e30, 0.0, 1.0, 1.0, 3e-38])
    x = base * scales[:, None]
    x[1, :32] *= 1e-6  # one block far below the rest of its row
    x[4, 40] = float("inf")
    x[5, 100] = float("nan")
    for rows in (x, x[4:5], x[1:2]):  # several rows, and the one-row path
        got = ops.quant_linear(rows, panels, n, None)
        want = rows.double() @ w
        finite = torch.isfinite(rows).all(dim=1)
        assert not torch.isfinite(got[~finite]).any()
        if not finite.any():
            continue
        # Relative to each row's own size (rows 1, 2 and 6 are 1e-30, 1e30 and 3e-38 x 1; the
        # last one's d 2^-e alone is below float32's normal range).
        size = (rows[finite].double().abs() @ w.abs()).clamp_min(1e-300)
        err = ((got[finite].double() - want[finite]) / size).abs().max()
        assert err < 1e-6, err
        assert (got[finite] == 0).all(dim=1).tolist() == (rows[finite] == 0).all(dim=1).tolist()


@pytest.mark.parametrize("scale_exp", [0, -30, -130, 40])
def test_quant_linear_rounds_x_to_nearest_even_at_every_scale(ops, scale_exp):
    """The integer path's one rounding, exactly: each 32-block of x is scaled by 2^e so its
    largest |x| is in [2^21, 2^22) and rounded to the nearest integer, ties to even (as
    nearbyint), whether the block takes the vector split or, when 2^e is out of float32's
    range (scale 2^-130), the scalar one. With every weight 1 (d = 1, m = 0, q = 1) the output
    is that sum of rounded values times 2^-e, exact in float32, so it must match bit for bit.
    A rounding that truncated, or rounded ties away from zero, would be off by whole units."""
    qtype = GGMLQuantizationType.Q4_1
    n, k = 16, 64
    block = np.zeros(20, np.uint8)
    block[0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)  # d
    block[2:4] = np.frombuffer(np.float16(0.0).tobytes(), np.uint8)  # m
    block[4:] = 0x11  # q = 1 for k and k + 16
    raw = np.tile(block, (n, k // 32))
    if ops.quant_panel_width(int(qtype)) == ops.panel_width():  # gemm.h: NBQ
        pytest.skip("this build multiplies Q4 blocks in float: x is not rounded")
    panels = ops.pack_gguf(torch.from_numpy(raw), int(qtype), k)
    halves = torch.arange(-31, 31, dtype=torch.float64)[:62] + 0.5  # ties: -30.5 .. 30.5
    top = torch.tensor([2.0**21 + 0.5, -(2.0**21) - 1.5])  # the blocks' largest: e = 0
    base = torch.cat([top[:1], halves[:31], top[1:], halves[31:]])
    x = (base * 2.0**scale_exp).float()[None, :]
    assert torch.equal(x[0].double() / 2.0**scale_exp, base)  # every value exact in float32
    rounded = torch.round(base.view(2, 32)).sum(dim=1)  # torch.round: half to even
    want = (rounded.sum() * 2.0**scale_exp).float()
    got = ops.quant_linear(x, panels, n, None)
    assert torch.equal(got, want.expand(1, n)), (got[0, 0].item(), want.item())


def test_quant_linear_takes_a_non_contiguous_x(ops):
    qtype = GGMLQuantizationType.Q4_1
    raw = _blocks(qtype, 200, 96, seed=11)
    panels = ops.pack_gguf(torch.from_numpy(raw), int(qtype), 96)
    x = torch.randn(96, 5).t()  # [5, 96], column-major
    assert not x.is_contiguous()
    got = ops.quant_linear(x, panels, 200, None)
    assert torch.equal(got, ops.quant_linear(x.contiguous(), panels, 200, None))
    torch.testing.assert_close(got, x @ _dequantized(raw, qtype), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_picks_blocks_then_panels_then_library(ops, qtype, bias):
    n, k = 200, 96
    w = _dequantized(_blocks(qtype, n, k, seed=1), qtype).contiguous()
    packed = ops.pack_weight(w)
    # The blocks hold a *different* matrix, so which path ran shows in the values.
    other = _blocks(qtype, n, k, seed=2)
    quant = ops.pack_gguf(torch.from_numpy(other), int(qtype), k)
    g = torch.Generator().manual_seed(5)
    b = torch.randn(n, generator=g) if bias else None
    limit, panels = ops.max_quant_rows(), ops.max_packed_rows()
    assert panels in (64, 256)  # AVX2 builds hand more rows to the library (gemm.cpp)
    for rows in sorted({1, 2, 6, 7, limit, limit + 1, 24, 25, 30, 64, 65, 256, 257, 300}):
        x = torch.randn(rows, k, generator=g)
        got = ops.linear(x, w, packed, quant, b)
        assert got.shape == (rows, n)
        if rows <= limit:
            assert torch.equal(got, ops.quant_linear(x, quant, n, b)), rows
            want = x @ _dequantized(other, qtype)
        elif rows <= panels:
            assert torch.equal(got, ops.packed_linear(x, packed, n, b)), rows
            want = x @ w
        else:
            want = x @ w
        if b is not None:
            want = want + b
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{rows} rows")
        # Without blocks, small batches fall to the float32 panels; without either, the library.
        if rows <= panels:
            assert torch.equal(
                ops.linear(x, w, packed, None, b), ops.packed_linear(x, packed, n, b)
            )
        library = x @ w if b is None else torch.addmm(b, x, w)
        assert torch.equal(ops.linear(x, w, None, None, b), library), rows


def test_panel_width_follows_the_build_target(ops, cpu_flags):
    # 64 columns only where the extension was built for AVX-512 (gemm.h), so a build for
    # another target (PAGEDSERVE_CPU_MARCH, tests/kernels/test_other_targets.py) is seen to
    # be one.
    from kernels import cpu

    march = cpu.march_flag()
    if march == "native":
        if not cpu_flags:
            pytest.skip("no /proc/cpuinfo to tell what native is")
        expected = 64 if "avx512f" in cpu_flags else 16
    else:
        known = {"x86-64": 16, "x86-64-v2": 16, "x86-64-v3": 16, "x86-64-v4": 64}
        if march not in known:
            pytest.skip(f"no expectation written down for -march={march}")
        expected = known[march]
    assert ops.panel_width() == expected, march


def test_max_quant_rows_follows_the_vector_width(ops):
    # 64 rows with VNNI (Q8 blocks then multiply in integers too, in one-vector panels), else
    # 12 with AVX-512 (64-column panels), 8 with AVX2 or less (16-column panels): the
    # crossovers measured in gemm.cpp. The test above checks linear() keeps to it.
    if ops.quant_panel_width(8) < ops.panel_width():
        assert ops.max_quant_rows() == 64
    else:
        assert ops.max_quant_rows() == (12 if ops.panel_width() == 64 else 8)


def test_quant_panel_width_follows_the_build_target(ops, cpu_flags):
    # Integer dot products (one-vector panels): Q4 with AVX2 or AVX-512BW (vpmaddubsw), Q8
    # only with VNNI; the float path's panels are panel_width() wide (gemm.h).
    from kernels import cpu

    vector = 16 if ops.panel_width() == 64 else 8
    march = cpu.march_flag()
    if march == "native":
        if not cpu_flags:
            pytest.skip("no /proc/cpuinfo to tell what native is")
        avx512 = "avx512f" in cpu_flags
        int_q4 = ("avx512bw" in cpu_flags) if avx512 else "avx2" in cpu_flags
        vnni = "avx512_vnni" in cpu_flags if avx512 else "avx_vnni" in cpu_flags
    else:
        known = {
            "x86-64": (False, False),
            "x86-64-v2": (False, False),
            "x86-64-v3": (True, False),
            "x86-64-v4": (True, False),
        }
        if march not in known:
            pytest.skip(f"no expectation written down for -march={march}")
        int_q4, vnni = known[march]
    for qtype, integer in ((3, int_q4 or vnni), (2, int_q4 or vnni), (8, vnni)):
        assert ops.quant_panel_width(qtype) == (vector if integer else ops.panel_width()), qtype
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        ops.quant_panel_width(0)


def test_pack_gguf_rejects_bad_input(ops):
    raw = torch.from_numpy(_blocks(GGMLQuantizationType.Q4_1, 64, 64, seed=0))
    for qtype in (0, 1, 6, 12, 14):  # F32, F16, Q5_0, Q4_K, Q6_K
        with pytest.raises(RuntimeError, match="unsupported ggml type"):
            ops.pack_gguf(raw, qtype, 64)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        ops.pack_gguf(raw[:, :-1].contiguous(), 3, 64)  # one byte short
    with pytest.raises(RuntimeError, match="bytes, expected"):
        ops.pack_gguf(raw, 2, 64)  # Q4_1 rows read as Q4_0
    with pytest.raises(RuntimeError, match="bytes, expected"):
        ops.pack_gguf(raw, 3, 96)  # in_features disagrees with the row length
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.pack_gguf(raw, 3, 48)
    with pytest.raises(RuntimeError):
        ops.pack_gguf(raw.view(torch.int8), 3, 64)  # not uint8
    with pytest.raises(RuntimeError):
        ops.pack_gguf(raw.flatten(), 3, 64)  # not 2-D


def test_quant_linear_rejects_bad_input(ops):
    panels = ops.pack_gguf(
        torch.from_numpy(_blocks(GGMLQuantizationType.Q8_0, 200, 96, seed=0)), 8, 96
    )
    with pytest.raises(RuntimeError, match="columns"):
        ops.quant_linear(torch.randn(3, 64), panels, 200, None)  # K 64, panels hold 96
    with pytest.raises(RuntimeError, match="columns"):
        ops.quant_linear(torch.randn(1, 128), panels, 200, None)
    with pytest.raises(RuntimeError):
        ops.quant_linear(torch.randn(3, 96, dtype=torch.float64), panels, 200, None)
    with pytest.raises(RuntimeError, match="not a quantized panel tensor"):
        ops.quant_linear(torch.randn(3, 96), panels[:, :, :-1].contiguous(), 200, None)
    with pytest.raises(RuntimeError):  # float32 panels are not blocks
        ops.quant_linear(torch.randn(3, 96), ops.pack_weight(torch.randn(96, 200)), 200, None)
