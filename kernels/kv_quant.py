"""The quantized KV cache's layout and arithmetic, shared by every kernel (torch only).

A quantized cache (``--kv-cache-dtype int8`` or ``fp8``) stores each (slot, KV head) row of
K or V as ``head_dim`` 8-bit values followed by that row's float16 scale, in one tensor::

    raw:    [num_blocks, block_size, num_kv_heads, head_dim + 2]  int8 / float8_e4m3fn
            |<-------- head_dim values -------->|<- scale: 2 bytes, float16 ->|
    values: raw[..., :head_dim]   (what kvpool hands the model: the usual 4-D cache shape,
                                   with stride(2) == head_dim + 2 instead of head_dim)

A kernel given ``values`` reads a row's scale at ``values[b, s, h].data_ptr() + head_dim``
bytes. Everything that moves blocks (copy-on-write, CUDA graphs' static tensors, the C++
stack's cache list) thus moves the scales with the values, and no signature changes. A
float16 scale (not float32) keeps a 16-bit model's cache at 2 * head_dim / (head_dim + 2) of
its size: 1.94x fewer bytes at head_dim 64 (1.88x with 4 bytes), 3.88x for float32.

**Keys are stored Hadamard-transformed.** Before quantizing, a K row (after RoPE) is
multiplied by the block-diagonal Hadamard matrix ``H`` (``hadamard``: blocks of
``hadamard_block(head_dim)`` channels, entries +-1, not normalized). Post-RoPE keys carry a
few outlier channels (the low-frequency RoPE pairs) 3-5x the others' magnitude, which set
every row's absmax scale and leave the other channels a few quantization steps; ``H``
spreads each outlier over its block, so the scale follows the row's RMS instead. Since
``H H = n I`` (``n`` the block size, a power of two), ``<q, k> = <H q, H k> / n``: a kernel
reading a quantized K cache transforms the query once (``H q``) and multiplies its softmax
scale by ``1 / n`` (exact), and the reference de-quantizes K back (``dequantize_keys``:
``H (q * scale) / n``). Values are stored as they are (their error moves no score: it
averages out in the weighted sum). The transform is a fixed butterfly order (``hadamard``),
evaluated in that same order by every implementation, so the bytes stay equal bit for bit.
Measured on the default model (benchmarks/RESULTS.md): the transform cuts the attention
error int8 keys cause by 77% and halves the logprob error; scaling K's channels against Q's
(foldable into the q/k weights, but only per RoPE pair) cut the attention error by 7-35%.

**Keys may be stored less a calibrated offset** (opt-in). Post-RoPE keys of a (layer, KV
head) share a large component common to every token (some channels carry a near-constant
offset), which widens each row's absmax scale and costs every other channel precision. The
store kernels take an optional ``key_offset`` ``[num_kv_heads, head_dim]`` float32 (with
``--kv-key-offsets`` the engine calibrates it per layer at start-up, the mean post-RoPE key
of a short text, and kvpool holds it) and quantize ``k - key_offset[h]`` instead of ``k``:
in float32, before the Hadamard transform.
Nothing adds it back: subtracting one vector ``m`` from every key of a head shifts each of a
query's scores by the same ``<q, m>``, and softmax is invariant to a shift, so attention over
the offset keys is attention over the keys (exact in real arithmetic; only the rounding
differs) and no attention kernel knows the offset. The cache's rows hold ``k - m``, which
stays valid as long as ``m`` does: for the model's lifetime, so prefix-cached and copied
blocks keep working. A zero offset, or none, stores exactly the bytes of no offset.

Quantization is symmetric, per (slot, KV head), from the row's absolute maximum:
``scale = float16(min(amax / QMAX, 65504))`` (QMAX 127 for int8, 448 for e4m3; round to
nearest even), ``q = x / float32(scale)`` rounded (int8: half away from zero,
``floor(|y| + 0.5)`` with the sign; fp8: the cast's round to nearest even) and clamped to
+-QMAX (float16's rounding may put the absmax a hair past QMAX); a row whose scale is 0 (all
zeros, or too small for float16) stores values 0. ``x ≈ q * scale``. Every implementation
(this reference, Triton, C++) evaluates these same float32 operations.
"""

from __future__ import annotations

import torch

__all__ = [
    "ELEMENT_DTYPES",
    "QMAX",
    "SCALE_BYTES",
    "SCALE_DTYPE",
    "SCALE_MAX",
    "cache_rows",
    "cache_scales",
    "check_key_offset",
    "dequantize",
    "dequantize_keys",
    "hadamard",
    "hadamard_block",
    "is_quantized",
    "quantize",
    "quantize_keys",
    "quantized_cache",
]

# The quantized --kv-cache-dtype spellings -> the cache's element type.
ELEMENT_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
# Largest magnitude a quantized value takes.
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float16  # one per (slot, KV head) row, after its values
SCALE_BYTES = 2
SCALE_MAX = 65504.0  # float16's largest finite value: larger scales are clamped to it


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QMAX


def quantized_cache(raw: torch.Tensor) -> torch.Tensor:
    """The values view of a ``[..., head_dim + 2]`` raw cache (see the module docstring)."""
    assert raw.dtype in QMAX and raw.is_contiguous(), (raw.dtype, raw.stride())
    head_dim = raw.shape[-1] - SCALE_BYTES
    assert head_dim > 0 and head_dim % 2 == 0, f"head_dim {head_dim} is not even"
    return raw[..., :head_dim]


def cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """The raw ``[num_blocks, block_size, num_kv_heads, head_dim + 2]`` tensor under a
    quantized cache's values view (same storage)."""
    nb, bs, kvh, d = cache.shape
    row = d + SCALE_BYTES
    assert cache.stride() == (bs * kvh * row, kvh * row, row, 1), (
        f"not a quantized cache layout: shape {tuple(cache.shape)}, strides {cache.stride()}"
    )
    return cache.as_strided((nb, bs, kvh, row), (bs * kvh * row, kvh * row, row, 1))


def cache_scales(cache: torch.Tensor) -> torch.Tensor:
    """The float16 scales ``[num_blocks, block_size, num_kv_heads]`` of a quantized cache
    (a view: writing it writes the cache)."""
    d = cache.shape[-1]
    scale_bytes = cache_rows(cache)[..., d:]  # [nb, bs, kvh, 2], last dim contiguous
    return scale_bytes.view(torch.uint8).view(SCALE_DTYPE).squeeze(-1)


def hadamard_block(head_dim: int) -> int:
    """The size ``n`` of the Hadamard blocks keys are transformed in: the largest power of
    two dividing ``head_dim / 2`` (64 -> 32, 128 -> 64, 96 -> 16), so that no block straddles
    the two RoPE halves of a row (the Triton rope kernel holds them apart)."""
    half = head_dim // 2
    return half & -half


def hadamard(x: torch.Tensor, block: int) -> torch.Tensor:  # [..., head_dim] float32
    """``x`` times the block-diagonal, unnormalized Hadamard matrix with ``block``-sized
    blocks, as butterflies in this fixed order (every implementation follows it, so the
    results are equal bit for bit): for h = 1, 2, 4, ..., block / 2, each pair of channels
    (i, i + h) with ``i % (2h) < h`` becomes (x_i + x_(i+h), x_i - x_(i+h)). Applied twice
    it multiplies by ``block``."""
    shape = x.shape
    h = 1
    while h < block:
        pairs = x.reshape(*shape[:-1], shape[-1] // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(shape)
        h *= 2
    return x


def quantize(
    x: torch.Tensor,  # [..., head_dim], any float dtype
    dtype: torch.dtype,  # torch.int8 or torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:  # values [..., head_dim] of dtype, scales [...] float16
    """Symmetric absmax quantization of each row (the module docstring's arithmetic)."""
    qmax = QMAX[dtype]
    x = x.float()
    scale = (x.abs().amax(dim=-1) / qmax).clamp_(max=SCALE_MAX).to(SCALE_DTYPE)  # [...]
    scale32 = scale.float()
    y = x / torch.where(scale32 > 0, scale32, 1.0)[..., None]
    if dtype == torch.int8:
        y = torch.copysign(torch.floor(y.abs() + 0.5), y)
    q = y.clamp(-qmax, qmax).to(dtype)
    return q, scale


def quantize_keys(
    x: torch.Tensor,  # [..., num_kv_heads, head_dim] keys after RoPE, any float dtype
    dtype: torch.dtype,
    key_offset: torch.Tensor | None = None,  # [num_kv_heads, head_dim] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # as quantize
    """``quantize`` of the Hadamard transform of the keys less ``key_offset`` (the module
    docstring): ``x - key_offset`` in float32, then the transform."""
    x = x.float()
    if key_offset is not None:
        check_key_offset(key_offset, x.shape[-2], x.shape[-1])
        x = x - key_offset
    return quantize(hadamard(x, hadamard_block(x.shape[-1])), dtype)


def check_key_offset(key_offset: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """A store's ``key_offset``: float32, contiguous, one row per KV head of the cache."""
    assert key_offset.dtype == torch.float32 and key_offset.is_contiguous(), (
        key_offset.dtype,
        key_offset.stride(),
    )
    assert key_offset.shape == (num_kv_heads, head_dim), (
        tuple(key_offset.shape),
        (num_kv_heads, head_dim),
    )


def dequantize(
    values: torch.Tensor,  # [..., head_dim] int8 / float8_e4m3fn
    scales: torch.Tensor,  # [...] float16
) -> torch.Tensor:  # [..., head_dim] float32
    return values.float() * scales.float()[..., None]


def dequantize_keys(
    values: torch.Tensor,  # [..., head_dim] int8 / float8_e4m3fn, from quantize_keys
    scales: torch.Tensor,  # [...] float16
) -> torch.Tensor:  # [..., head_dim] float32: the keys less their offset (transform undone)
    block = hadamard_block(values.shape[-1])
    return hadamard(dequantize(values, scales), block) * (1.0 / block)
