"""Triton matmul against a per-output-channel quantized weight (int8, or fp8 e4m3 on CUDA).

Import the launcher explicitly (``kernels/__init__.py`` never imports triton)::

    from kernels.quant_matmul import quant_matmul

Same signature and semantics as ``kernels.reference.quant_matmul``: ``y = x @ (weight *
scale) + bias`` with ``weight`` stored ``[in_features K, out_features N]`` (the model's
``Linear`` layout, N contiguous) in 1 byte a value. Weight-only quantization: the activations
stay in the model's dtype, each weight tile is converted in registers (exact: int8 and e4m3
values are bf16/fp16/fp32 values), products are summed in float32, and each output column is
scaled once at the end. A decode step reads 1 byte a weight instead of 2 (bf16); its time is
the weight bytes read, which is why decode does not quantize the activations as
``torch._int_mm`` would (that needs ``M > 16`` and pays a per-token quantization per matmul).

``dense_matmul`` runs the same split-K decode kernel on a weight in the activations' own
dtype, unscaled (``DENSE``; ``kernels.reference.dense_matmul`` is its twin): a CUDA engine's
decode matmuls with ``PAGEDSERVE_DECODE_MATMUL=triton``. Both launchers take ``pdl=``: the
split-K kernel and its reduction as programmatic dependent launches, the first loading each
program's first weight tile before it waits for the kernel before (``SplitKLaunch.prefetch``;
no kernel of a step writes a weight), so its weight stream starts while that kernel ends.

Three paths, by the number of rows M (``choose_launch``; ``launch=`` overrides it):

- **Decode, M <= DECODE_ROWS (16): split-K** (``SplitKLaunch``, ``_quant_matmul_split_k_kernel``).
  A decode matmul is a weight stream: the bound is how many bytes are in flight, not the
  arithmetic. Grid ``(cdiv(N, BLOCK_N), num_splits, cdiv(M, BLOCK_M))``: each program streams
  a ``BLOCK_N``-column strip (64-256 bytes contiguous a K row: whole 32-byte sectors and 128-byte
  lines) over one of ``num_splits`` equal runs of whole ``BLOCK_K`` tiles of K, so that even a
  4,096-column matmul is several programs per SM. A split run writes float32 partials
  ``[num_splits, M, N]``; a second kernel, ``_reduce_splits_kernel``, sums them in a fixed
  order (one compiled reduction tree: no atomics, so results are the same run to run and
  between a CUDA graph's replay and an eager call), scales each column, adds the bias and
  casts. (Not by default a merge by the last split to arrive: for split-K decode attention
  on an H100 a second kernel in the same graph was faster, kernels/README.md.)
  ``SplitKLaunch.one_launch`` is that merge, for the sweep to time against the second
  kernel: the last split of each strip to take a ticket from an arrival counter
  (``_triton_common.arrival_counters``) runs the same summing code. One split does all of
  that in the first kernel. Each program multiplies either on the tensor cores
  (``dot``: ``tl.dot`` on a tile of at least 16 rows, most of them masked off at M = 1) or
  without them (``dot=False``: a broadcast multiply accumulated in a ``[BLOCK_M, BLOCK_K,
  BLOCK_N]`` float32 tile, summed over K once after the loop, as Inductor's reductions do;
  no layout change to dot operands, but ``BLOCK_M`` times the registers, so for 1-4 rows).
  Either form copies its weight tiles into shared memory ``num_stages - 1`` iterations ahead
  (``tl.range``), and the broadcast form converts int8 to float32 with an integer add and a
  float subtract rather than the slower int-to-float conversion.
- **17..LIBRARY_ROWS rows: the tiled kernel** (``TiledLaunch``, ``_quant_matmul_kernel``),
  grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``, every program a strip through the whole K.
  Above 16 rows a tile reuses each weight byte for 32-64 rows, and split-K partials would
  cost ``8 * num_splits * M * N`` bytes more.
- **More than LIBRARY_ROWS rows** (prefill): the library's matmul on the weight converted to
  the activation dtype: these kernels are not tuned for compute-bound shapes.

The decode launch parameters come from a sweep on an H100 (``choose_launch``'s docstring):
``python -m benchmarks.kernels --quant-matmul`` (benchmarks/quant_matmul_sweep.py) times the
candidates at the Llama-3-8B shapes and prints the best per row. Shapes and grids come from
the arguments only (CUDA-graph safe: no host sync, nothing read from the data).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from kernels._common import SUPPORTED_DTYPES, num_compute_units
from kernels._triton_common import (
    TL_DTYPES,
    arrival_counters,
    dot_args,
    last_to_arrive,
    pdl_args,
    pdl_enter,
)
from kernels.matmul_tuning import LIBRARY, MatmulTuning, check_split_k_fields, matmul_tuning_env
from kernels.settings import DECODE_ROWS, next_power_of_2

__all__ = [
    "DECODE_ROWS",
    "LIBRARY_ROWS",
    "WEIGHT_DTYPES",
    "QuantLaunch",
    "SplitKLaunch",
    "TiledLaunch",
    "choose_launch",
    "two_programs_regs",
    "dense_matmul",
    "quant_matmul",
    "split_k_rows",
    "tile_shape",
]

WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)
# Batches of more rows multiply on the library (cuBLAS) path; decode batches and CUDA graphs
# stay within it.
LIBRARY_ROWS = 256
# choose_launch's split-K targets: at least this many weight columns streamed at once per
# SM (programs in flight times their strip width: enough loads outstanding to cover DRAM
# latency, and a last wave that is a small share of the run), and K runs of at least this
# many rows (shorter runs spend more of their time in the pipeline's fill and the partials).
TARGET_COLUMNS = 512
MIN_SPLIT_ROWS = 256
# _reduce_splits_kernel's column strip.
REDUCE_BLOCK_N = 256


@dataclass(frozen=True, slots=True)
class SplitKLaunch:
    """How one call of the split-K decode kernel runs (what the tuning sweep varies)."""

    block_m: int = 16  # rows a program multiplies: >= 16 with dot, a power of two
    block_n: int = 128  # columns (bytes of a K row) a program streams
    block_k: int = 64  # K rows a loop iteration loads; splits are whole tiles
    num_splits: int = 1  # split-K factor before split_k_rows recounts it (1 = no split)
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True  # tl.dot on the tensor cores; False: broadcast multiply + sum over K
    # Load each program's first weight tile before the point where it depends on the kernel
    # before (its x): what a programmatic dependent launch overlaps with that kernel's end.
    # A PDL launch always does; without one it only moves a load (same products, bitwise).
    prefetch: bool = False
    # With more than one split: the last split of each column strip to finish sums the
    # strip's partials in the same launch (an arrival counter per strip, as decode
    # attention's one-launch merge), instead of a second kernel. The same sums.
    one_launch: bool = False
    # Registers a thread may hold (ptxas's .maxnreg), 0: the compiler's choice. The
    # one-launch sum at one row and 8 warps takes more than 128 (Triton 3.9: 154 plain;
    # 3.6: 168 as a dependent launch), so one program an SM where split-K's targets assume
    # two; two_programs_regs(8) = 128 caps it (kernels/README.md). The same sums:
    # registers change no result.
    maxnreg: int = 0


def two_programs_regs(num_warps: int) -> int:
    """The most registers a thread may hold for two programs of ``num_warps`` to share an
    SM (65,536 registers; ptxas allows at most 255): what ``maxnreg`` caps."""
    return min(255, 65536 // (2 * 32 * num_warps))


@dataclass(frozen=True, slots=True)
class TiledLaunch:
    """How one call of the tiled kernel runs (``tile_shape``'s tiles, Triton's default
    warps and stages)."""

    block_m: int
    block_n: int
    block_k: int


QuantLaunch = SplitKLaunch | TiledLaunch


@triton.jit
def _load_x(x_ptr, offs_m, k, mask_m, K, stride_x_m):
    """The ``[BLOCK_M, BLOCK_K]`` activation tile at K rows ``k`` (masked loads read 0)."""
    return tl.load(
        x_ptr + offs_m[:, None] * stride_x_m + k[None, :],
        mask=mask_m[:, None] & (k < K)[None, :],
        other=0.0,
    )


@triton.jit
def _load_w(weight_ptr, offs_n, k, mask_n, K, N, FP8: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` weight tile at K rows ``k`` (masked loads read 0); an FP8
    weight comes back as e4m3 values."""
    w = tl.load(
        weight_ptr + k[:, None] * N + offs_n[None, :],
        mask=(k < K)[:, None] & mask_n[None, :],
        other=0,
    )
    if FP8:  # loaded as bytes: masked-off bytes are 0, which is e4m3's +0.0
        w = w.to(tl.float8e4nv, bitcast=True)
    return w


@triton.jit
def _load_tiles(x_ptr, weight_ptr, offs_m, offs_n, k, mask_m, mask_n, K, N, stride_x_m,
                FP8: tl.constexpr):  # fmt: skip
    """The activation and weight tiles at K rows ``k`` (``_load_x``, ``_load_w``)."""
    x = _load_x(x_ptr, offs_m, k, mask_m, K, stride_x_m)
    return x, _load_w(weight_ptr, offs_n, k, mask_n, K, N, FP8)


@triton.jit
def _multiply_add(acc, x, w, DOT: tl.constexpr, FP8: tl.constexpr, DENSE: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """``acc`` plus the products of one K tile: ``tl.dot`` into ``[BLOCK_M, BLOCK_N]``, or
    (not DOT) each product added into its own element of ``[BLOCK_M, BLOCK_K, BLOCK_N]``.

    The broadcast form's ``x * w`` in float32 is exact for bf16/fp16 x times 8-bit weights
    (8 or 11 significant bits times int8's 7 or e4m3's 4) or times weights of x's dtype (at
    most 11 + 11 of float32's 24); rounded once for float32 x, as tl.dot's "ieee" products
    are."""
    if DOT:
        # Integer and e4m3 weights convert exactly to the dot's dtype.
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    else:
        if FP8 or DENSE:
            w = w.to(tl.float32)
        else:
            # Exactly w, without the int-to-float conversion unit (16 a clock an SM on sm_90,
            # about the weight bytes an SM must consume at full bandwidth): the float32 with
            # bits 0x4B000000 + (w + 128) is 2^23 + 128 + w.
            w = (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        acc += x.to(tl.float32)[:, :, None] * w[None, :, :]
    return acc


@triton.jit
def _store_scaled(out_ptr, acc, scale_ptr, bias_ptr, offs_m, offs_n, mask_m, mask_n, N,
                  HAS_BIAS: tl.constexpr, DENSE: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """``acc`` (float32 sums) times each column's scale (none if DENSE), plus the bias, cast
    and stored."""
    if not DENSE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * N + offs_n[None, :],
        acc.to(DTYPE),
        mask=mask_m[:, None] & mask_n[None, :],
    )


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
        x, w = _load_tiles(
            x_ptr, weight_ptr, offs_m, offs_n, k0 + offs_k, mask_m, mask_n, K, N, stride_x_m, FP8
        )
        # The weight's integer (or e4m3) values convert exactly to the dot's dtype.
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    _store_scaled(
        out_ptr, acc, scale_ptr, bias_ptr, offs_m, offs_n, mask_m, mask_n, N, HAS_BIAS, False,
        DTYPE,
    )  # fmt: skip


@triton.jit
def _quant_matmul_split_k_kernel(
    out_ptr,  # [M, N] contiguous, x's dtype (written when not SPLIT)
    partial_ptr,  # [num_splits, M, N] float32 (written when SPLIT)
    counters_ptr,  # [cdiv(M, BLOCK_M) * strips] int32, zero between launches (COMBINE only)
    x_ptr,  # [M, K], rows strided
    weight_ptr,  # [K, N] contiguous: int8, uint8 of float8e4nv bits (FP8), x's dtype (DENSE)
    scale_ptr,  # [N] float32 (unused if DENSE)
    bias_ptr,  # [N] x's dtype (unused without HAS_BIAS)
    M,
    N,
    K,
    k_per_split,  # K rows of each split, a multiple of BLOCK_K (the last split may be short)
    stride_x_m: tl.int64,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,  # the weight's bytes are e4m3 values (else int8, or DENSE)
    DENSE: tl.constexpr,  # the weight is in x's dtype, unscaled (dense_matmul)
    SPLIT: tl.constexpr,  # write unscaled float32 partials (else the finished output)
    COMBINE: tl.constexpr,  # SPLIT: the strip's last split sums them (SplitKLaunch.one_launch)
    SPLITS_PAD: tl.constexpr,  # COMBINE: next power of two >= the splits
    DOT: tl.constexpr,  # tl.dot (BLOCK_M >= 16); else broadcast multiply, summed over K
    PREFETCH: tl.constexpr,  # the first weight tile loaded before the dependency point
    PDL: tl.constexpr,  # a programmatic dependent launch (kernels/_triton_common.pdl_enter)
    BLOCK_M: tl.constexpr,  # a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    # K tiles in flight: tl.range copies the weight tiles of either form into shared memory
    # this many iterations ahead (without it only loads that feed tl.dot are pipelined)
    NUM_STAGES: tl.constexpr,
    DTYPE: tl.constexpr,  # the activations' (and output's) dtype
    DOT_DTYPE: tl.constexpr,  # tl.dot operand type, see kernels/_triton_common.dot_args
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * k_per_split
    # NOTE: split boundaries are whole BLOCK_K tiles, so a tile never crosses into the next
    # split and `k < K` is the only K mask a tile needs; no split is empty (split_k_rows),
    # so its first tile is always its own.
    k_end = tl.minimum(k_start + k_per_split, K)
    if PREFETCH:
        # NOTE: no kernel of a step writes a weight, so this load may run while the kernel
        # before (which writes x) is still running (pdl_enter). At batch 1 that kernel is a
        # few microseconds of latency (a norm, SiLU, attention's merge) during which this
        # launch's programs stream their first tiles instead of waiting idle.
        w_first = _load_w(weight_ptr, offs_n, k_start + offs_k, mask_n, K, N, FP8)
    pdl_enter(PDL)
    if DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        # Products accumulate element by element; the one cross-thread sum over K is after
        # the loop, not in it.
        acc = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N), dtype=tl.float32)
    loop_start = k_start
    if PREFETCH:  # the first tile's products, then the loop from the second
        x_first = _load_x(x_ptr, offs_m, k_start + offs_k, mask_m, K, stride_x_m)
        acc = _multiply_add(acc, x_first, w_first, DOT, FP8, DENSE, DOT_DTYPE, DOT_PRECISION)
        loop_start += BLOCK_K
    for k0 in tl.range(loop_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        x, w = _load_tiles(
            x_ptr, weight_ptr, offs_m, offs_n, k0 + offs_k, mask_m, mask_n, K, N, stride_x_m,
            FP8,
        )  # fmt: skip
        acc = _multiply_add(acc, x, w, DOT, FP8, DENSE, DOT_DTYPE, DOT_PRECISION)
    if not DOT:
        acc = tl.sum(acc, axis=1)
    if SPLIT:
        row = pid_k * M + offs_m  # int64: partial row of (split, m)
        tl.store(
            partial_ptr + row[:, None] * N + offs_n[None, :],
            acc,
            mask=mask_m[:, None] & mask_n[None, :],
        )
        if COMBINE:
            # The last split of the strip to store its partials sums them all.
            counter = counters_ptr + pid_m * tl.num_programs(0) + pid_n
            if last_to_arrive(counter, tl.num_programs(1)):
                first = pid_m.to(tl.int64) * BLOCK_M  # int64 rows: m * N below
                for m in range(first, tl.minimum(first + BLOCK_M, M)):
                    _sum_splits(
                        out_ptr, partial_ptr, scale_ptr, bias_ptr, m, offs_n,
                        mask_n, M, N, tl.num_programs(1), HAS_BIAS, DENSE, SPLITS_PAD, DTYPE,
                        ".cg",
                    )  # fmt: skip
    else:
        _store_scaled(
            out_ptr, acc, scale_ptr, bias_ptr, offs_m, offs_n, mask_m, mask_n, N, HAS_BIAS,
            DENSE, DTYPE,
        )  # fmt: skip


@triton.jit
def _sum_splits(out_ptr, partial_ptr, scale_ptr, bias_ptr, m, offs_n, mask_n, M, N, num_splits,
                HAS_BIAS: tl.constexpr, DENSE: tl.constexpr, SPLITS_PAD: tl.constexpr,
                DTYPE: tl.constexpr, CACHE: tl.constexpr):  # fmt: skip
    """Row ``m``'s columns ``offs_n``: the sum of its splits' partials (all loaded at once,
    summed by one reduction tree fixed at compile time), times the column scale (none if
    DENSE), plus the bias, cast and stored."""
    splits = tl.arange(0, SPLITS_PAD).to(tl.int64)
    partial = tl.load(
        partial_ptr + (splits[:, None] * M + m) * N + offs_n[None, :],
        mask=(splits[:, None] < num_splits) & mask_n[None, :],
        other=0.0,
        cache_modifier=CACHE,
    )
    acc = tl.sum(partial, axis=0)
    if not DENSE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * N + offs_n, acc.to(DTYPE), mask=mask_n)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [M, N] contiguous, x's dtype
    partial_ptr,  # [num_splits, M, N] float32
    scale_ptr,  # [N] float32 (unused if DENSE)
    bias_ptr,  # [N] x's dtype (unused without HAS_BIAS)
    M,
    N,
    num_splits,
    HAS_BIAS: tl.constexpr,
    DENSE: tl.constexpr,  # no column scales
    PDL: tl.constexpr,  # a programmatic dependent launch (kernels/_triton_common.pdl_enter)
    SPLITS_PAD: tl.constexpr,  # next power of two >= num_splits
    BLOCK_N: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """One row's column strip of the split-K kernel's output (``_sum_splits``)."""
    pdl_enter(PDL)
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    _sum_splits(
        out_ptr, partial_ptr, scale_ptr, bias_ptr, tl.program_id(1).to(tl.int64), offs_n,
        offs_n < N, M, N, num_splits, HAS_BIAS, DENSE, SPLITS_PAD, DTYPE, "",
    )  # fmt: skip


def tile_shape(rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the tiled kernel for a batch of ``rows``. Batches of
    17-256 rows run it (32 or 64 rows a tile, 64 x 64 weight tiles). Decode batches (<= 16
    rows) take the split-K kernel instead; their tiled launch (narrow 32-column strips,
    128-row K steps: about one program per SM at 4,096 columns) is what the split-K path
    replaced, kept as the sweep's baseline."""
    if rows <= DECODE_ROWS:
        return 16, 32, 128
    return (32 if rows <= 32 else 64), 64, 64


def split_k_rows(k: int, block_k: int, num_splits: int) -> tuple[int, int]:
    """(K rows per split, splits): ``num_splits`` runs of whole ``block_k`` tiles, recounted
    so that none is empty (e.g. K 200 in tiles of 32 at 3 splits: 3 tiles, 96 rows each, 3
    splits; at 5 splits: 2 tiles each, 4 splits)."""
    tiles = max(1, triton.cdiv(k, block_k))
    tiles_per_split = triton.cdiv(tiles, max(1, min(num_splits, tiles)))
    return tiles_per_split * block_k, triton.cdiv(tiles, tiles_per_split)


def choose_launch(rows: int, n: int, k: int, num_sms: int) -> QuantLaunch:
    """The launch ``quant_matmul`` uses for ``[rows, k] @ [k, n]`` on ``num_sms`` SMs.

    Decode batches (``rows <= DECODE_ROWS``) run split-K (module docstring), with what the
    sweep (``python -m benchmarks.kernels --quant-matmul``) found fastest at the Llama-3-8B
    shapes on an H100 (benchmarks/RESULTS.md):

    - one row multiplies without tl.dot (``dot=False``, ``block_m`` 1): a 16-row dot tile
      would be 15/16 padding. Strips of ``block_n`` 256 (each K row 256 contiguous bytes),
      8 warps: the accumulator tile ``block_m * block_k * block_n`` is 64 float32 values a
      thread, the most that fits without spilling (128-column strips were slower);
    - more rows use tl.dot on one 16-row tile (the broadcast tile's registers grow with
      rows), 128-column strips, 4 warps;
    - ``block_k`` 64, copied into shared memory 2 tiles ahead (``num_stages`` 3) in either
      form (32-row K tiles and 2, 4 or 6 stages were within the run-to-run spread, or slower);
    - split-K: ``TARGET_COLUMNS`` weight columns in flight per SM (2 programs of 256, 4 of
      128), every split at least ``MIN_SPLIT_ROWS`` K rows. On an H100 (132 SMs) at batch 1
      the Llama-3-8B shapes take: qkv 4,096 x 6,144 (24 strips) 11 splits of 384 rows; o
      4,096 x 4,096 (16) 16 of 256; gate/up 4,096 x 28,672 (112) 3; down 14,336 x 4,096
      (16) 16 of 896; the LM head (501 strips) 1. The float32 partials add ``8 * splits *
      rows * n`` bytes (written, then read back, mostly in L2), so runs of at least
      ``MIN_SPLIT_ROWS`` keep them within ``rows / 32`` of the weight's ``k * n`` bytes: at
      most half, at 16 rows. A tighter cap (1/8) cost more than it saved: at 16 rows it
      allowed the qkv projection 4 splits, which ran slower than 11.

    ``num_sms`` 0 (off CUDA, where the interpreter runs programs one after another and a
    split only adds work) gives one split. Larger batches run the tiled kernel
    (``tile_shape``).
    """
    if rows > DECODE_ROWS:
        return TiledLaunch(*tile_shape(rows))
    dot = rows > 1
    block_m = 16 if dot else 1
    block_n, block_k = (128, 64) if dot else (256, 64)
    num_warps = 4 if dot else 8
    columns = n * triton.cdiv(rows, block_m)
    by_parallelism = triton.cdiv(TARGET_COLUMNS * num_sms, columns)
    by_length = k // MIN_SPLIT_ROWS
    num_splits = max(1, min(by_parallelism, by_length))
    return SplitKLaunch(block_m, block_n, block_k, num_splits, num_warps, 3, dot)


@functools.lru_cache(maxsize=256)  # once per launch: the launchers call it on every matmul
def _check_split_k(launch: SplitKLaunch) -> None:
    try:
        check_split_k_fields(asdict(launch))
    except ValueError as e:
        raise ValueError(f"{launch}: {e}") from None


def _weight_kind(weight: torch.Tensor) -> str:
    """The weight's name in a tuning table (kernels/matmul_tuning.py)."""
    if weight.dtype == torch.int8:
        return "int8"
    if weight.dtype == torch.float8_e4m3fn:
        return "fp8"
    return str(weight.dtype).removeprefix("torch.")


def _tuned_launch(weight: torch.Tensor, m: int, n: int, k: int) -> SplitKLaunch | str | None:
    """The launch ``PAGEDSERVE_MATMUL_TUNING``'s table gives this decode batch (a
    ``SplitKLaunch`` or ``LIBRARY``), None where no table is set or it lacks the shape."""
    table = matmul_tuning_env()
    if table is None or m > DECODE_ROWS:
        return None
    return _table_launch(table, _weight_kind(weight), m, n, k)


@functools.lru_cache(maxsize=1024)  # the launchers ask on every eager matmul
def _table_launch(
    table: MatmulTuning, weight: str, m: int, n: int, k: int
) -> SplitKLaunch | str | None:
    launch = table.lookup(weight, m, n, k)
    return launch if launch is None or isinstance(launch, str) else SplitKLaunch(**launch)


def quant_matmul(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [in_features, out_features] int8 or float8_e4m3fn, contiguous
    scale: torch.Tensor,  # [out_features] float32
    bias: torch.Tensor | None = None,  # [out_features]
    *,
    launch: QuantLaunch | None = None,
    pdl: bool | None = None,  # split-K as a programmatic dependent launch; None: PAGEDSERVE_PDL's
) -> torch.Tensor:  # [num_tokens, out_features], x's dtype
    """``x @ (weight * scale) + bias``; rows of ``x`` may be strided, not columns.

    ``launch``: run this launch instead of ``choose_launch``'s (tuning and tests); any
    launch computes the same product, up to float32 summation order. Without it a decode
    batch takes ``PAGEDSERVE_MATMUL_TUNING``'s launch where its table has the shape
    (kernels/matmul_tuning.py). Batches of more than ``LIBRARY_ROWS`` rows always take the
    library's matmul.
    """
    _check_operands(x, weight, bias)
    assert weight.dtype in WEIGHT_DTYPES, weight.dtype
    assert scale.dtype == torch.float32 and scale.shape == (weight.shape[1],)
    m, k = x.shape
    n = weight.shape[1]
    if m > LIBRARY_ROWS:
        y = (x @ weight.to(x.dtype)).float() * scale
        return (y if bias is None else y + bias.float()).to(x.dtype)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if launch is None:
        tuned = _tuned_launch(weight, m, n, k)
        assert tuned != LIBRARY, "a tuning table never sends a quantized weight to the library"
        launch = tuned or choose_launch(m, n, k, num_compute_units(x.device) if x.is_cuda else 0)
    fp8 = weight.dtype == torch.float8_e4m3fn
    w = weight.view(torch.uint8) if fp8 else weight
    b = bias if bias is not None else scale
    if isinstance(launch, TiledLaunch):
        tiles = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n))
        _quant_matmul_kernel[tiles](
            out, x, w, scale, b, m, n, k, x.stride(0),
            HAS_BIAS=bias is not None, FP8=fp8, BLOCK_M=launch.block_m,
            BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, DTYPE=TL_DTYPES[x.dtype],
            **dot_args(_quant_matmul_kernel, x.dtype),
        )  # fmt: skip
        return out
    return _split_k(out, x, w, scale, bias, launch, pdl, fp8=fp8, dense=False)


def dense_matmul(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [in_features, out_features] in x's dtype, contiguous
    bias: torch.Tensor | None = None,  # [out_features]
    *,
    launch: SplitKLaunch | None = None,
    pdl: bool | None = None,  # a programmatic dependent launch; None: PAGEDSERVE_PDL's
) -> torch.Tensor:  # [num_tokens, out_features], x's dtype
    """``x @ weight + bias`` for a weight in the activations' dtype: the split-K decode
    kernel for at most ``DECODE_ROWS`` rows (``kernels.reference.dense_matmul`` is its
    twin: float32 sums, rounded once), the library's matmul for more. Without ``launch`` a
    batch takes ``PAGEDSERVE_MATMUL_TUNING``'s launch where its table has the shape, which
    may be the library's matmul (kernels/matmul_tuning.py), else ``choose_launch``'s.

    Why a decode step would take it over cuBLAS (``PAGEDSERVE_DECODE_MATMUL=triton``,
    engine/backends/cuda.py): as a programmatic dependent launch it streams its first weight
    tiles while the kernel before it ends, so the short kernels between a layer's matmuls
    stop being bubbles in the weight stream, and every launch of a layer can chain. Whether
    that beats the library's own GEMV is a GPU measurement (kernels/README.md).
    """
    _check_operands(x, weight, bias)
    assert weight.dtype == x.dtype, (weight.dtype, x.dtype)
    m, k = x.shape
    n = weight.shape[1]
    tuned = _tuned_launch(weight, m, n, k) if launch is None else None
    if m > DECODE_ROWS or tuned == LIBRARY:
        return x @ weight if bias is None else torch.addmm(bias, x, weight)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if launch is None:
        launch = tuned or choose_launch(m, n, k, num_compute_units(x.device) if x.is_cuda else 0)
        assert isinstance(launch, SplitKLaunch)
    return _split_k(out, x, weight, None, bias, launch, pdl, fp8=False, dense=True)


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[0], (
        tuple(x.shape),
        tuple(weight.shape),
    )
    assert x.dtype in SUPPORTED_DTYPES, x.dtype
    assert weight.is_contiguous(), "the weight must be contiguous [in_features, out_features]"
    assert bias is None or bias.shape == (weight.shape[1],)
    assert x.stride(1) == 1, "rows of x must be contiguous"


def _split_k(
    out: torch.Tensor,  # [m, n], x's dtype
    x: torch.Tensor,
    weight: torch.Tensor,  # int8, uint8 (fp8's bytes), or x's dtype (dense)
    scale: torch.Tensor | None,  # None: dense
    bias: torch.Tensor | None,
    launch: SplitKLaunch,
    pdl: bool | None,
    *,
    fp8: bool,
    dense: bool,
) -> torch.Tensor:
    """The split-K kernel at ``launch`` into ``out``, then the reduction of its partials
    where there is more than one split. With PDL both kernels are dependent launches."""
    _check_split_k(launch)
    m, k = x.shape
    n = weight.shape[1]
    k_per_split, num_splits = split_k_rows(k, launch.block_k, launch.num_splits)
    split = num_splits > 1
    # One float32 partial row per (split, row); unsplit, the kernel writes `out` itself.
    partial = (
        torch.empty((num_splits, m, n), dtype=torch.float32, device=x.device) if split else out
    )
    pdl_launch = pdl_args(pdl, x.device)
    # Never read where unused (DENSE, no bias), but every pointer argument needs a tensor.
    s = scale if scale is not None else out
    b = bias if bias is not None else s
    grid = (triton.cdiv(n, launch.block_n), num_splits, triton.cdiv(m, launch.block_m))
    combine = split and launch.one_launch
    counters = arrival_counters(x.device, grid[0] * grid[2], "quant_matmul") if combine else partial
    _quant_matmul_split_k_kernel[grid](
        out, partial, counters, x, weight, s, b, m, n, k, k_per_split, x.stride(0),
        HAS_BIAS=bias is not None, FP8=fp8, DENSE=dense, SPLIT=split, COMBINE=combine,
        SPLITS_PAD=next_power_of_2(num_splits) if combine else 1, DOT=launch.dot,
        PREFETCH=launch.prefetch or bool(pdl_launch["PDL"]), BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, NUM_STAGES=launch.num_stages,
        DTYPE=TL_DTYPES[x.dtype], **dot_args(_quant_matmul_split_k_kernel, x.dtype),
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_launch,
        **({"maxnreg": launch.maxnreg} if launch.maxnreg else {}),
    )  # fmt: skip
    if split and not combine:
        _reduce_splits_kernel[(triton.cdiv(n, REDUCE_BLOCK_N), m)](
            out, partial, s, b, m, n, num_splits, HAS_BIAS=bias is not None, DENSE=dense,
            SPLITS_PAD=next_power_of_2(num_splits), BLOCK_N=REDUCE_BLOCK_N,
            DTYPE=TL_DTYPES[x.dtype], **pdl_launch,
        )  # fmt: skip
    return out
