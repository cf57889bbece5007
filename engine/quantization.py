"""Weights quantized at load (``--quantization int8|fp8``): a transform of the loaded model.

``quantize_model(model, mode)`` (what the engine builder calls) swaps, from outside, every
``Linear`` of a loaded ``LlamaForCausalLM`` (``engine/llama.py``: the fused q/k/v, o,
gate/up and down projections of every layer, and the LM head) for a ``QuantizedLinear`` that
holds the weight in one byte a value and one float32 scale per output channel, as gpt-fast's
int8 handler does; the model definition knows nothing of it (``quantize_linears`` does the
swap with a given matmul).

The format, symmetric per output channel (``quantize_weight``): column ``n`` of a weight
``[in, out]`` gets ``scale[n] = max_k |w[k, n]| / QMAX`` and ``q[k, n] = w[k, n] / scale[n]``
rounded to the format: int8 rounds to the nearest integer in [-127, 127] (|error| <=
scale / 2), fp8 (e4m3, QMAX 448) to 3 mantissa bits (|error| <= |w| / 16, or 2^-10 scale
near zero). The weight the model multiplies by is ``q * scale`` (``dequantize_weight``).

Where each matmul runs:

- plain PyTorch (any device; the torch attention backend): ``kernels.reference.quant_matmul``
  converts the weight on every call (saves memory, not time);
- CUDA: ``kernels/quant_matmul.py``, a Triton kernel that converts weight tiles in
  registers (int8 and fp8; 1 byte a weight read instead of bf16's 2);
- the C++ CPU stack (``engine/backends/cpu.py``, int8 only): batches of up to
  ``max_quant_rows()`` rows (64 with AVX-512 VNNI, 12 with AVX-512, 8 with AVX2) multiply by
  the int8 values packed as Q8 panels (``pack_int8``, kernels/cpu/csrc/gemm_q.cpp: 9 bits a
  weight); larger batches by the float32 panels of ``q * scale``, the same weights.

Not quantized: the embedding (a step looks up one row a token, so its size is not read per
step) and the norms. Not supported: fp8 on the CPU (no fp8 matmul there; one clear error).

Owns: the quantized weights (``QuantizedLinear.qweight``, ``.scale``); the float ones are
freed as each matmul is swapped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ModelError
from engine.llama import Linear
from kernels import reference

log = logging.getLogger(__name__)

QUANTIZATION_MODES = ("int8", "fp8")
QMAX = {"int8": 127.0, "fp8": 448.0}

QuantMatmul = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]


class UnsupportedQuantizationError(ModelError, ValueError):
    """A ``--quantization`` this device cannot run; the command line reports it as one
    line."""


def check_supported(mode: str, device: torch.device) -> None:
    """Raise ``UnsupportedQuantizationError`` unless ``mode`` runs on ``device``."""
    if mode not in QUANTIZATION_MODES:
        raise UnsupportedQuantizationError(
            f"--quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}"
        )
    if mode == "fp8" and device.type != "cuda":
        raise UnsupportedQuantizationError(
            "--quantization fp8 needs a CUDA GPU (e4m3 weights through the Triton matmul); "
            "on the CPU use --quantization int8"
        )


def quantize_weight(
    weight: torch.Tensor,  # [in_features, out_features], any float dtype
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [in, out] (int8 or float8_e4m3fn), scale [out] f32
    """Symmetric per-output-channel quantization (module docstring). A column of zeros gets
    scale 1 (and zeros), so no scale is 0 and every value is finite."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=0)
    scale = torch.where(amax > 0, amax / QMAX[mode], torch.ones_like(amax))
    scaled = w / scale
    if mode == "int8":
        q = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        q = scaled.clamp_(-QMAX[mode], QMAX[mode]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:  # [in, out]
    """The weight a quantized matmul multiplies by: ``q * scale``, one float32 rounding
    (bit for bit what the C++ panels de-quantize to), then cast to ``dtype``."""
    return (q.float() * scale).to(dtype)


class QuantizedLinear(nn.Module):
    """``y = x @ (qweight * scale) + bias``; the quantized twin of ``engine.llama.Linear``
    (same ``[in, out]`` layout).

    ``matmul`` is the function that multiplies (``kernels.reference.quant_matmul`` or the
    Triton launcher of the same signature), fixed when the transform builds the module."""

    def __init__(
        self,
        qweight: torch.Tensor,  # [in_features, out_features] int8 or float8_e4m3fn
        scale: torch.Tensor,  # [out_features] float32
        bias: nn.Parameter | None,
        mode: str,
        matmul: QuantMatmul = reference.quant_matmul,
    ) -> None:
        super().__init__()
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = bias
        self.mode = mode
        self.matmul = matmul

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [in, out]
        return dequantize_weight(self.qweight.detach(), self.scale.detach(), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        return self.matmul(x, self.qweight, self.scale, self.bias)


@dataclass(frozen=True, slots=True)
class QuantReport:
    """What ``quantize_linears`` did, for the start-up log and the MBU byte model."""

    mode: str
    num_matmuls: int
    body_float_bytes: int  # the decoder layers' matmul weights before
    body_quant_bytes: int  # ... and after (values + scales)
    lm_head_float_bytes: int
    lm_head_quant_bytes: int

    @property
    def body_saved_bytes(self) -> int:
        return self.body_float_bytes - self.body_quant_bytes

    def summary(self, dtype: torch.dtype) -> str:
        before = self.body_float_bytes + self.lm_head_float_bytes
        after = self.body_quant_bytes + self.lm_head_quant_bytes
        return (
            f"quantized {self.num_matmuls} matmul weights to {self.mode} (per-output-channel "
            f"scales): {before / 1e6:.0f} MB of {str(dtype).removeprefix('torch.')} -> "
            f"{after / 1e6:.0f} MB ({before / max(after, 1):.2f}x fewer bytes); "
            "the embedding and the norms stay float"
        )


def quantize_model(model: nn.Module, mode: str) -> QuantReport:
    """``quantize_linears`` with the matmul for the model's device (the Triton kernel on
    CUDA, the reference elsewhere; the C++ CPU backend then takes the int8 weights over,
    ``engine/backends/cpu.py``), logging what it did."""
    weight = next(model.parameters())
    check_supported(mode, weight.device)
    matmul: QuantMatmul = reference.quant_matmul
    if weight.device.type == "cuda":
        from kernels.quant_matmul import quant_matmul as matmul
    report = quantize_linears(model, mode, matmul=matmul)
    log.info("%s", report.summary(weight.dtype))
    return report


def quantize_linears(
    model: nn.Module, mode: str, *, matmul: QuantMatmul = reference.quant_matmul
) -> QuantReport:
    """Swap every ``Linear`` of ``model`` for a ``QuantizedLinear`` in ``mode``, in place,
    freeing each float weight as it goes (peak memory: the model plus one weight).

    Args:
        model: a loaded ``LlamaForCausalLM`` (any dtype, any device).
        mode: "int8" or "fp8".
        matmul: what the quantized modules multiply with (the reference by default).
    """
    if mode not in QUANTIZATION_MODES:
        raise UnsupportedQuantizationError(f"unknown quantization {mode!r}")
    # (parent, name) only: holding the modules here would keep every float weight alive.
    swaps = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is Linear
    ]
    body_float = body_quant = head_float = head_quant = 0
    with torch.no_grad():
        for parent, name in swaps:
            linear = getattr(parent, name)
            w = linear.weight
            q, scale = quantize_weight(w, mode)
            quant = QuantizedLinear(q, scale, linear.bias, mode, matmul)
            float_bytes = w.numel() * w.element_size()
            quant_bytes = q.numel() * q.element_size() + scale.numel() * scale.element_size()
            if name == "lm_head":
                head_float, head_quant = float_bytes, quant_bytes
            else:
                body_float += float_bytes
                body_quant += quant_bytes
            setattr(parent, name, quant)
            del linear, w
    return QuantReport(mode, len(swaps), body_float, body_quant, head_float, head_quant)
