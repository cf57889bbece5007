"""The quantized KV cache's layout and arithmetic, shared by every kernel (torch only).

A quantized cache (``--kv-cache-dtype int8`` or ``fp8``) stores each (slot, KV head) row of
K or V as ``head_dim`` 8-bit values followed by that row's float32 scale, in one tensor::

    raw:    [num_blocks, block_size, num_kv_heads, head_dim + 4]  int8 / float8_e4m3fn
            |<-------- head_dim values -------->|<- scale: 4 bytes, float32 ->|
    values: raw[..., :head_dim]   (what kvpool hands the model: the usual 4-D cache shape,
                                   with stride(2) == head_dim + 4 instead of head_dim)

A kernel given ``values`` reads a row's scale at ``values[b, s, h].data_ptr() + head_dim``
bytes. Everything that moves blocks (copy-on-write, CUDA graphs' static tensors, the C++
stack's cache list) thus moves the scales with the values, and no signature changes.

Quantization is symmetric, per (slot, KV head), from the row's absolute maximum:
``scale = amax / QMAX`` (127 for int8, 448 for e4m3), ``q = x / scale`` rounded (int8:
half away from zero, ``floor(|y| + 0.5)`` with the sign; fp8: the cast's round to nearest
even) and clamped; a row of zeros gets scale 0 and values 0. ``x ≈ q * scale``.
Every implementation (this reference, Triton, C++) evaluates these same float32 operations.
"""

from __future__ import annotations

import torch

__all__ = [
    "ELEMENT_DTYPES",
    "QMAX",
    "SCALE_BYTES",
    "cache_rows",
    "cache_scales",
    "dequantize",
    "is_quantized",
    "quantize",
    "quantized_cache",
]

# The quantized --kv-cache-dtype spellings -> the cache's element type.
ELEMENT_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
# Largest magnitude a quantized value takes.
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_BYTES = 4  # one float32 per (slot, KV head) row, after its values


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QMAX


def quantized_cache(raw: torch.Tensor) -> torch.Tensor:
    """The values view of a ``[..., head_dim + 4]`` raw cache (see the module docstring)."""
    assert raw.dtype in QMAX and raw.is_contiguous(), (raw.dtype, raw.stride())
    head_dim = raw.shape[-1] - SCALE_BYTES
    assert head_dim > 0 and head_dim % SCALE_BYTES == 0, f"head_dim {head_dim} not a multiple of 4"
    return raw[..., :head_dim]


def cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """The raw ``[num_blocks, block_size, num_kv_heads, head_dim + 4]`` tensor under a
    quantized cache's values view (same storage)."""
    nb, bs, kvh, d = cache.shape
    row = d + SCALE_BYTES
    assert cache.stride() == (bs * kvh * row, kvh * row, row, 1), (
        f"not a quantized cache layout: shape {tuple(cache.shape)}, strides {cache.stride()}"
    )
    return cache.as_strided((nb, bs, kvh, row), (bs * kvh * row, kvh * row, row, 1))


def cache_scales(cache: torch.Tensor) -> torch.Tensor:
    """The float32 scales ``[num_blocks, block_size, num_kv_heads]`` of a quantized cache
    (a view: writing it writes the cache)."""
    d = cache.shape[-1]
    scale_bytes = cache_rows(cache)[..., d:]  # [nb, bs, kvh, 4], last dim contiguous
    return scale_bytes.view(torch.uint8).view(torch.float32).squeeze(-1)


def quantize(
    x: torch.Tensor,  # [..., head_dim], any float dtype
    dtype: torch.dtype,  # torch.int8 or torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:  # values [..., head_dim] of dtype, scales [...] float32
    """Symmetric absmax quantization of each row (the module docstring's arithmetic)."""
    qmax = QMAX[dtype]
    x = x.float()
    scale = x.abs().amax(dim=-1) / qmax  # [...]
    y = x / torch.where(scale > 0, scale, 1.0)[..., None]
    if dtype == torch.int8:
        y = torch.copysign(torch.floor(y.abs() + 0.5), y)
    q = y.clamp(-qmax, qmax).to(dtype)
    return q, scale


def dequantize(
    values: torch.Tensor,  # [..., head_dim] int8 / float8_e4m3fn
    scales: torch.Tensor,  # [...] float32
) -> torch.Tensor:  # [..., head_dim] float32
    return values.float() * scales[..., None]
