"""Triton ``quant_matmul`` vs ``kernels.reference.quant_matmul``, and the reference vs the
float matmul with the de-quantized weight; ``dense_matmul`` (the same split-K kernel on a
weight in the activations' dtype) vs ``kernels.reference.dense_matmul``.

CPU: under TRITON_INTERPRET=1 (conftest.py). CUDA: compiled. Tolerance: both sum in float32
and scale each column once, in different orders (split-K sums each split's run of K, then
the splits; the broadcast form sums a tile's K rows as a tree): float32 within
``TOLERANCES`` of the kernel tests (atol 2e-5, rtol 1e-4: at K <= 200 and outputs of
magnitude ~10 the orders differ by ~1e-6); bf16/fp16 outputs within one ulp of the dtype at
the output's magnitude (both round a float32 sum once). The reference against ``x @ (q *
scale)`` in float64: 1e-6 of ``|x| @ |W|`` (float32 summation error).

The split-K decode launches are forced with ``launch=`` (off CUDA the default launch never
splits): shapes with N not a multiple of any strip, K not a multiple of a tile or of a
split's run of tiles, and rows beyond one program's ``block_m``.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from engine.quantization import dequantize_weight, quantize_weight
from kernels import reference
from kernels.quant_matmul import (
    DECODE_ROWS,
    LIBRARY_ROWS,
    MIN_SPLIT_ROWS,
    TARGET_COLUMNS,
    SplitKLaunch,
    TiledLaunch,
    choose_launch,
    dense_matmul,
    quant_matmul,
    split_k_rows,
    tile_shape,
)
from tests.kernels.conftest import assert_counters_zero
from tests.kernels.sm90_builds import builds_of

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


# Forced split-K launches over K = 200 (tiles of 16/32/64 do not divide it) and N = 100:
# (block_m, block_n, block_k, num_splits, num_warps, num_stages, dot).
SPLIT_K_LAUNCHES = {
    "row": SplitKLaunch(1, 64, 32, 1, 4, 3, dot=False),
    "row-split3": SplitKLaunch(1, 64, 32, 3, 8, 3, dot=False),  # 3 runs of 96, 96, 8 rows
    "rows2-split5": SplitKLaunch(2, 32, 16, 5, 4, 2, dot=False),  # 5 of 48 (the last 8)
    "dot": SplitKLaunch(16, 32, 64, 1, 4, 3, dot=True),
    "dot-split4": SplitKLaunch(16, 64, 32, 4, 4, 3, dot=True),  # 4 of 64 (the last 8)
}


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("name", list(SPLIT_K_LAUNCHES))
def test_split_k_launches_match_reference(device, close, name, rows):
    x, q, scale, b = _case(rows, 200, 100, torch.float32, "int8", device, bias=rows % 2 == 1)
    got = quant_matmul(x, q, scale, b, launch=SPLIT_K_LAUNCHES[name])
    assert_matches(got, reference.quant_matmul(x, q, scale, b), close)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["row-split3", "dot-split4"])
def test_split_k_dtypes_and_formats(device, close, mode, dtype, name):
    rows = 1 if name.startswith("row") else 3
    x, q, scale, b = _case(rows, 200, 100, dtype, mode, device, bias=True)
    got = quant_matmul(x, q, scale, b, launch=SPLIT_K_LAUNCHES[name])
    assert_matches(got, reference.quant_matmul(x, q, scale, b), close)


@pytest.mark.parametrize("name", ["row-split3", "rows2-split5", "dot-split4"])
def test_split_k_strided_rows(device, close, name):
    x, q, scale, b = _case(6, 200, 100, torch.float32, "int8", device, bias=True)
    wide = torch.zeros(6, 232, device=device)
    wide[:, :200] = x
    launch = SPLIT_K_LAUNCHES[name]
    for view in (wide[:, :200], x[::2]):
        want = reference.quant_matmul(view.contiguous(), q, scale, b)
        close(quant_matmul(view, q, scale, b, launch=launch), want)


def test_split_k_is_deterministic(device):
    """No atomics: the splits are summed in one fixed order, so two calls agree bit for bit."""
    x, q, scale, b = _case(3, 200, 100, torch.bfloat16, "int8", device, bias=True)
    for launch in (SPLIT_K_LAUNCHES["rows2-split5"], SPLIT_K_LAUNCHES["dot-split4"]):
        first = quant_matmul(x, q, scale, b, launch=launch)
        assert torch.equal(first, quant_matmul(x, q, scale, b, launch=launch))


def test_tiled_launch_runs_at_decode_rows(device, close):
    """The tiled kernel at the decode tiles (the sweep's baseline) on one row."""
    x, q, scale, b = _case(1, 200, 100, torch.float32, "fp8", device, bias=True)
    got = quant_matmul(x, q, scale, b, launch=TiledLaunch(*tile_shape(1)))
    close(got, reference.quant_matmul(x, q, scale, b))


def test_split_k_rows_are_whole_tiles_and_none_empty():
    assert split_k_rows(200, 32, 3) == (96, 3)
    assert split_k_rows(200, 32, 5) == (64, 4)  # 7 tiles: 2 a split fill 4 splits
    assert split_k_rows(200, 32, 64) == (32, 7)  # at most one split a tile
    assert split_k_rows(4096, 64, 1) == (4096, 1)
    for k, block_k, splits in ((200, 16, 5), (14336, 64, 17), (100, 128, 4)):
        rows, count = split_k_rows(k, block_k, splits)
        assert rows % block_k == 0 and (count - 1) * rows < k <= count * rows


# Llama-3-8B's matmuls (K, N) at batch 1 on an H100's 132 SMs: the heuristic's splits after
# the recount (qkv, o, gate/up, down, LM head), which the sweep found fastest at 256-column
# strips (benchmarks/RESULTS.md).
LLAMA_3_8B = {(4096, 6144): 11, (4096, 4096): 16, (4096, 28672): 3, (14336, 4096): 16,
              (4096, 128256): 1}  # fmt: skip


def test_choose_launch_fills_an_h100_at_batch_1():
    for (k, n), splits in LLAMA_3_8B.items():
        launch = choose_launch(1, n, k, 132)
        assert isinstance(launch, SplitKLaunch) and not launch.dot and launch.block_m == 1
        _, count = split_k_rows(k, launch.block_k, launch.num_splits)
        assert count == splits, (k, n, launch)
        assert launch.block_n == 256 and launch.num_warps == 8, launch
        # several strips per SM (the LM head's 501 already are), none idle
        assert n * count >= 0.9 * TARGET_COLUMNS * 132 or count == 1, (k, n, count)


def test_choose_launch_by_rows():
    # 2-16 rows: one 16-row tl.dot tile, fewer splits as the partials grow with rows
    for rows in (2, 16):
        launch = choose_launch(rows, 4096, 4096, 132)
        assert isinstance(launch, SplitKLaunch) and launch.dot and launch.block_m == 16
        assert launch.block_n == 128 and launch.num_warps == 4, launch
    # qkv and o at 16 rows: as many splits as at 1 row (128-column strips, 16 rows a tile)
    assert choose_launch(16, 6144, 4096, 132).num_splits == 11
    assert choose_launch(16, 4096, 4096, 132).num_splits == 16
    # a narrow, deep matmul: runs of MIN_SPLIT_ROWS K rows bound the splits
    assert choose_launch(16, 64, 1 << 15, 132).num_splits == (1 << 15) // MIN_SPLIT_ROWS
    assert choose_launch(DECODE_ROWS + 1, 4096, 4096, 132) == TiledLaunch(32, 64, 64)
    assert choose_launch(64, 4096, 4096, 132) == TiledLaunch(*tile_shape(64))
    # off CUDA (no SMs to fill): never a split
    for rows in (1, 16):
        assert choose_launch(rows, 100, 1 << 14, 0).num_splits == 1


def test_rejects_bad_launch(device):
    x, q, scale, _ = _case(2, 64, 48, torch.float32, "int8", device, bias=False)
    with pytest.raises(ValueError, match="16 rows"):  # tl.dot needs 16 rows
        quant_matmul(x, q, scale, launch=SplitKLaunch(8, 64, 32, dot=True))
    with pytest.raises(ValueError, match="power of two"):
        quant_matmul(x, q, scale, launch=SplitKLaunch(1, 48, 32, dot=False))


# ---- prefetch: the first weight tile before the dependency point ---------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPLIT_K_LAUNCHES))
def test_prefetch_is_bitwise_the_plain_launch(device, mode, dtype, name):
    """The first tile's products computed ahead of the loop are the loop's first iteration:
    the same bits, split or not, broadcast or tl.dot, at every row count a launch covers."""
    launch = SPLIT_K_LAUNCHES[name]
    for rows in (1, 3):
        if rows > launch.block_m and not launch.dot:
            continue
        x, q, scale, b = _case(rows, 200, 100, dtype, mode, device, bias=True)
        plain = quant_matmul(x, q, scale, b, launch=launch)
        got = quant_matmul(x, q, scale, b, launch=replace(launch, prefetch=True))
        assert torch.equal(got, plain), (name, rows)


def test_pdl_is_refused_where_it_cannot_run(device):
    """A programmatic dependent launch needs compiled kernels on compute capability >= 9.0:
    anywhere else asking for one is one clear error, and pdl=None (PAGEDSERVE_PDL unset)
    runs the plain launch."""
    from kernels._triton_common import pdl_supported

    if pdl_supported(torch.device(device)):
        pytest.skip("this device runs programmatic dependent launches")
    x, q, scale, b = _case(1, 200, 100, torch.float32, "int8", device, bias=True)
    with pytest.raises(ValueError, match="programmatic dependent launch"):
        quant_matmul(x, q, scale, b, launch=SPLIT_K_LAUNCHES["row-split3"], pdl=True)
    with pytest.raises(ValueError, match="programmatic dependent launch"):
        dense_matmul(x, q.float(), b, pdl=True)
    assert dense_matmul(x, q.float(), b, pdl=None).shape == (1, 100)


# ---- one launch: the last split of each strip sums them -----------------------------------


@pytest.mark.parametrize("mode", [*MODES, "dense"])
@pytest.mark.parametrize("name", ["row-split3", "rows2-split5", "dot-split4"])
def test_one_launch_sums_the_splits_as_the_reduction_does(device, close, mode, name):
    """The strip's last split to arrive sums the partials in the kernel that wrote them:
    the reference's product, the same on every call, with the arrival counters back at
    zero for the next launch (a CUDA graph replays with them); under the interpreter
    bitwise the two-launch path's (the same summing code; compiled, its tile may differ)."""
    launch = replace(SPLIT_K_LAUNCHES[name], one_launch=True)
    for rows in (1, 2) if not launch.dot else (1, 3, 16):
        if mode == "dense":
            x, w, b = _dense_case(rows, 200, 100, torch.bfloat16, device, bias=True)
            run = functools.partial(dense_matmul, x, w, b)
            want = reference.dense_matmul(x, w, b)
        else:
            x, q, scale, b = _case(rows, 200, 100, torch.bfloat16, mode, device, bias=True)
            run = functools.partial(quant_matmul, x, q, scale, b)
            want = reference.quant_matmul(x, q, scale, b)
        got = run(launch=launch)
        assert_matches(got, want, close)
        assert torch.equal(run(launch=launch), got)
        assert torch.equal(run(launch=replace(launch, prefetch=True)), got)
        # Registers capped for two programs an SM (stage D's launch at 8 warps): the same
        # instructions' results (compiled: the same tile, so bitwise too)
        assert torch.equal(run(launch=replace(launch, maxnreg=128)), got)
        assert_counters_zero(device)
        if device.type == "cpu":
            assert torch.equal(run(launch=replace(launch, one_launch=False)), got)


# ---- dense_matmul: weights in the activations' dtype ------------------------------------


def _dense_case(rows: int, k: int, n: int, dtype: torch.dtype, device, bias: bool):
    g = torch.Generator().manual_seed(rows * 5 + k + n)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(k, n, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(x), move(w), move(b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SPLIT_K_LAUNCHES))
def test_dense_split_k_matches_reference(device, close, dtype, name):
    """Every forced launch, with and without the prefetched first tile (the same bits), at
    each dtype: float32 sums rounded once, as the reference (and the library) rounds."""
    launch = SPLIT_K_LAUNCHES[name]
    for rows in (1, 2, 16) if launch.dot else (1, 2):
        x, w, b = _dense_case(rows, 200, 100, dtype, device, bias=rows != 2)
        got = dense_matmul(x, w, b, launch=launch)
        assert_matches(got, reference.dense_matmul(x, w, b), close)
        assert torch.equal(dense_matmul(x, w, b, launch=replace(launch, prefetch=True)), got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_default_launch_and_shapes(device, close, dtype):
    """choose_launch's launch (on a GPU, split), strided rows, an empty batch, and past
    DECODE_ROWS the library's matmul: each the reference's product."""
    x, w, b = _dense_case(DECODE_ROWS + 4, 96, 200, dtype, device, bias=True)
    for view in (x[:1], x[:DECODE_ROWS:3], x):
        assert_matches(dense_matmul(view, w, b), reference.dense_matmul(view, w, b), close)
    assert_matches(dense_matmul(x[:2], w), reference.dense_matmul(x[:2], w), close)
    assert dense_matmul(x[:0], w).shape == (0, 200)


def test_dense_rejects_bad_input(device):
    x, w, _ = _dense_case(2, 64, 48, torch.float32, device, bias=False)
    with pytest.raises(AssertionError):
        dense_matmul(x, w.to(torch.bfloat16))  # not the activations' dtype
    with pytest.raises(AssertionError):
        dense_matmul(x, w.t().contiguous().t())  # not [in, out] contiguous
    with pytest.raises(AssertionError):
        dense_matmul(x[:, :32], w)  # inner sizes differ


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_k_graph_replay_is_bitwise_eager():
    """Captured in a CUDA graph (the workspace from the graph's pool, no host reads), a
    split launch replays to the eager call's bits, on new input values too."""
    x, q, scale, b = _case(4, 4096, 4096, torch.bfloat16, "int8", "cuda", bias=True)
    launch = choose_launch(4, 4096, 4096, 132)
    assert isinstance(launch, SplitKLaunch) and launch.num_splits > 1
    quant_matmul(x, q, scale, b, launch=launch)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_matmul(x, q, scale, b, launch=launch)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, quant_matmul(x, q, scale, b, launch=launch))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
def test_dense_graph_replay_is_bitwise_eager(pdl, one_launch):
    """dense_matmul at a Llama-3-8B qkv shape, split, captured behind the kernel that
    writes its input (a norm, as in a layer) and replayed: the eager call's bits, with
    the first weight tiles loaded before the wait where it is a dependent launch, and
    with the splits summed by a second kernel or by the last split (its arrival counters
    allocated by the eager call, kept zero by the replays)."""
    from kernels._triton_common import pdl_supported
    from kernels.rms_norm import rms_norm

    if pdl and not pdl_supported(torch.device("cuda")):
        pytest.skip("this GPU cannot run programmatic dependent launches")
    h, w, b = _dense_case(1, 4096, 6144, torch.bfloat16, "cuda", bias=False)
    norm = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    launch = choose_launch(1, 6144, 4096, torch.cuda.get_device_properties(0).multi_processor_count)
    assert isinstance(launch, SplitKLaunch) and launch.num_splits > 1
    launch = replace(launch, one_launch=one_launch)

    def step() -> torch.Tensor:
        return dense_matmul(rms_norm(h, norm, 1e-6, pdl=pdl), w, b, launch=launch, pdl=pdl)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        h.copy_(torch.randn_like(h))
        graph.replay()
        eager = dense_matmul(rms_norm(h, norm, 1e-6, pdl=False), w, b, launch=launch, pdl=False)
        assert torch.equal(out, eager)


@pytest.mark.parametrize("build", builds_of("quant_matmul"))
def test_compiles_for_sm90(sm90_build_errors, build):
    """The compiled (non-interpreted) kernel builds for an H100, even on a CPU-only machine."""
    assert sm90_build_errors[build] is None, sm90_build_errors[build]
