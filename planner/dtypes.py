"""Data types the planner knows: their storage size and the dtype the matmuls run in.

Three dtypes matter to the arithmetic and they may differ:

- the *weight* dtype sets the bytes every forward step streams from memory;
- the *KV* dtype sets the bytes per cached token (an int8/fp8 KV cache beside bf16 weights
  is common);
- the *compute* dtype picks the device's peak FLOP/s.

Quantized weights run their matmuls in the quantized dtype only where the device has tensor
cores for it (W8A8 int8, fp8 on Ada/Hopper); otherwise they are dequantized on the fly and
multiply in 16-bit (weight-only quantization: GGUF Q4, AWQ, GPTQ, Marlin fp8 on Ampere).
"""

from __future__ import annotations

from collections.abc import Mapping

# Bytes per element. int4 is half a byte: the arithmetic is in float, so this stays exact.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}
WEIGHT_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8")

# Spellings users (and torch / HF configs) use for the same thing.
_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
}


def canonical_dtype(name: str) -> str:
    """Return the planner's short name (``fp32``, ``bf16``, ...) for a dtype spelling."""
    key = name.strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPE_BYTES)}")
    return key


def dtype_bytes(name: str) -> float:
    """Bytes per element of ``name`` (0.5 for int4)."""
    return DTYPE_BYTES[canonical_dtype(name)]


def compute_dtype(weight_dtype: str, peak_flops: Mapping[str, float]) -> str:
    """The dtype whose peak FLOP/s bounds the matmuls of a model stored in ``weight_dtype``.

    Args:
        weight_dtype: the weights' dtype.
        peak_flops: the device's dense peak per dtype; only its keys are read.

    Returns:
        ``weight_dtype`` itself when the device lists a peak for it; for int8/fp8/int4
        weights on a device without that tensor-core path, the 16-bit dtype they are
        dequantized to (bf16 if the device has it, else fp16, else fp32).
    """
    w = canonical_dtype(weight_dtype)
    if w in peak_flops:
        return w
    if w in ("fp8", "int8", "int4"):
        for fallback in ("bf16", "fp16", "fp32"):
            if fallback in peak_flops:
                return fallback
    raise ValueError(
        f"the device has no {w} peak (it lists {sorted(peak_flops)}); pick another --dtype"
    )
