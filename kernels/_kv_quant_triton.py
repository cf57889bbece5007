"""Triton device functions for the quantized KV cache (layout: ``kernels/kv_quant.py``).

Inlined into the store kernels (``quantize_rows``, ``scale_ptrs``, ``hadamard_rows`` on
keys) and the attention loops (``scale_ptrs``, and ``hadamard_rows`` on the query). They
evaluate the reference's float32 operations in the same order (the Hadamard butterflies
too), so a quantized value differs from ``kv_quant.quantize``'s only where compiled division
rounds differently (a value one step off at a rounding tie; the interpreter matches exactly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels import kv_quant

__all__ = [
    "hadamard_rows",
    "key_offset_arg",
    "quant_args",
    "quantize_by",
    "quantize_rows",
    "row_scales",
    "scale_ptrs",
]


def quant_args(kernel: object, cache: torch.Tensor) -> dict[str, object]:
    """The ``QUANTIZED``, ``QMAX``, ``ROUND_TO_INT``, ``SOFT_FP8_ROUND`` and
    ``HADAMARD_BLOCK`` (``kv_quant.hadamard_block``; 1 for a float cache) constexprs of
    ``kernel`` storing into ``cache``.

    ``SOFT_FP8_ROUND``: Triton 3.x's interpreter converts float32 to e4m3 wrongly where
    rounding carries into the exponent (127.9 becomes 64, not 128), so under the interpreter
    the kernels round to the e4m3 grid in software first (then the cast is exact); compiled
    kernels use the hardware conversion (round to nearest even, as torch).
    """
    quantized = kv_quant.is_quantized(cache)
    return {
        "QUANTIZED": quantized,
        "QMAX": kv_quant.QMAX[cache.dtype] if quantized else 0.0,
        "ROUND_TO_INT": cache.dtype == torch.int8,
        "SOFT_FP8_ROUND": isinstance(kernel, InterpretedFunction)
        and cache.dtype == torch.float8_e4m3fn,
        "HADAMARD_BLOCK": kv_quant.hadamard_block(cache.shape[-1]) if quantized else 1,
    }


def key_offset_arg(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    key_offset: torch.Tensor | None,  # [num_kv_heads, head_dim] float32
) -> tuple[torch.Tensor, bool]:
    """A store kernel's ``key_offset_ptr`` and ``HAS_KEY_OFFSET`` for ``key_offset``
    (``kv_quant.quantize_keys``); without one, the cache stands in for the pointer, which
    the kernel then never reads."""
    if key_offset is None:
        return key_cache, False
    assert kv_quant.is_quantized(key_cache), "a key offset is for a quantized cache only"
    kv_quant.check_key_offset(key_offset, key_cache.shape[2], key_cache.shape[3])
    assert key_offset.device == key_cache.device, (key_offset.device, key_cache.device)
    return key_offset, True


@triton.jit
def scale_ptrs(row_ptrs, HEAD_DIM: tl.constexpr):
    """float16 pointers to the scales of the cache rows that start at ``row_ptrs``."""
    return (row_ptrs + HEAD_DIM).to(tl.pointer_type(tl.float16))


@triton.jit
def _butterfly(x, ROWS: tl.constexpr, WIDTH: tl.constexpr, H: tl.constexpr):
    """One stage of ``kv_quant.hadamard``: channels (i, i + H), i % 2H < H, of each row
    become (x_i + x_(i+H), x_i - x_(i+H))."""
    pairs = tl.permute(tl.reshape(x, [ROWS, WIDTH // (2 * H), 2, H]), (0, 1, 3, 2))
    a, b = tl.split(pairs)  # [ROWS, WIDTH // 2H, H] each
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [ROWS, WIDTH])


@triton.jit
def hadamard_rows(x, ROWS: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """``kv_quant.hadamard(x, BLOCK)`` of ``x`` [ROWS, WIDTH] float32 (WIDTH a power of two,
    a multiple of BLOCK; padding columns past the row stay 0 when whole blocks of them are
    0), stage by stage in the reference's order; BLOCK 1 returns ``x``."""
    for stage in tl.static_range(BLOCK.bit_length() - 1):
        x = _butterfly(x, ROWS, WIDTH, 1 << stage)
    return x


@triton.jit
def round_to_e4m3(y):
    """``y`` (float32, |y| <= 448) rounded to the nearest e4m3 value, ties to even: the grid
    step is 2**(max(exponent, -6) - 3) (3 mantissa bits; below 2**-6, subnormals)."""
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    t = tl.abs(y) / step  # exact: a power of two; < 16
    r = ((t + 8388608.0) - 8388608.0) * step  # 2**23: float32 addition rounds to an integer
    return tl.where(y < 0, -r, r)


@triton.jit
def quantize_by(
    x, scale, QMAX: tl.constexpr, ROUND_TO_INT: tl.constexpr, SOFT_FP8_ROUND: tl.constexpr
):
    """``x`` [R, C] float32 divided by its rows' ``scale`` [R] (0: the row stays 0), rounded
    with ``ROUND_TO_INT`` (int8: half away from zero, ``copysign(floor(|y| + 0.5), y)``;
    fp8 rounds in the store's cast, or here with ``SOFT_FP8_ROUND``) and clamped to +-QMAX."""
    y = x / tl.where(scale > 0, scale, 1.0)[:, None]
    if ROUND_TO_INT:
        r = tl.floor(tl.abs(y) + 0.5)
        y = tl.where(y < 0, -r, r)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if SOFT_FP8_ROUND:
        y = round_to_e4m3(y)
    return y


@triton.jit
def row_scales(amax, QMAX: tl.constexpr):
    """The float16 scale of rows whose absolute maximum is ``amax`` [R] (float32):
    ``float16(min(amax / QMAX, 65504))``, rounded to nearest even, returned as float32."""
    return tl.minimum(amax / QMAX, 65504.0).to(tl.float16).to(tl.float32)


@triton.jit
def quantize_rows(x, QMAX: tl.constexpr, ROUND_TO_INT: tl.constexpr, SOFT_FP8_ROUND: tl.constexpr):
    """Symmetric absmax quantization of each row of ``x`` ([R, C] float32, masked columns
    0): ``(quantize_by(x, scale), scale)`` with ``scale = row_scales(amax)`` [R]."""
    scale = row_scales(tl.max(tl.abs(x), axis=1), QMAX)
    return quantize_by(x, scale, QMAX, ROUND_TO_INT, SOFT_FP8_ROUND), scale
