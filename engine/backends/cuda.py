"""The CUDA backend's layer ops: the model's norms and SiLU-times-up as fused Triton kernels.

``fuse_layer_ops`` replaces, from outside, every ``RMSNorm`` of a loaded model with a
``TritonRMSNorm`` and every ``SiluAndMul`` with a ``TritonSiluAndMul`` holding the same weight
tensors: one launch each (``add_norm_`` adds the residual in the same launch) instead of
the four to eight elementwise kernels the plain ops take in bf16. RoPE fused with the K/V
store comes with the Triton attention backend (``PagedAttention.rope_and_store``). With them
a decoder layer launches four small kernels besides its matmuls and attention. Each op's
result is the plain op's (``kernels/reference.py`` holds the twins the kernels are tested
against), and every launch is CUDA-graph safe: grids from shapes only, no host reads.

With ``PAGEDSERVE_DECODE_MATMUL=triton`` it also swaps every dense ``Linear`` for a
``TritonLinear``: decode batches (at most ``DECODE_ROWS`` rows) multiply with the split-K
Triton kernel instead of the library's (``kernels.quant_matmul.dense_matmul``), so that with
``PAGEDSERVE_PDL=1`` a layer's launches are one chain of programmatic dependent launches, each
matmul streaming its first weight tiles while the kernel before it ends.

Imports Triton: the builder imports this module only for a CUDA engine. The decode steps'
CUDA graphs (``engine/cuda_graphs.py``) replay the model after this.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.llama import Linear, RMSNorm, SiluAndMul
from kernels.quant_matmul import DECODE_ROWS, dense_matmul
from kernels.rms_norm import add_rms_norm_, rms_norm
from kernels.silu_mul import silu_mul


class TritonRMSNorm(RMSNorm):
    def __init__(self, norm: RMSNorm) -> None:
        nn.Module.__init__(self)
        self.weight = norm.weight  # the same Parameter: no copy
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_norm_(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return add_rms_norm_(x, residual, self.weight, self.eps)


class TritonSiluAndMul(SiluAndMul):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)


class TritonLinear(Linear):
    """A dense ``Linear`` whose decode batches run ``dense_matmul`` (float32 sums rounded
    once, as the library's matmul, in another order); larger batches, the library's."""

    def __init__(self, linear: Linear) -> None:
        nn.Module.__init__(self)
        self.weight = linear.weight  # the same Parameters: no copy
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > DECODE_ROWS or x.stride(1) != 1:
            return super().forward(x)
        return dense_matmul(x, self.weight, self.bias)


def fuse_layer_ops(model: nn.Module, *, triton_matmuls: bool = False) -> int:
    """Swap the model's norms and activations for their Triton versions, in place, and with
    ``triton_matmuls`` its dense ``Linear`` layers for ``TritonLinear``; returns how many
    modules were replaced."""
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is RMSNorm:
                swaps.append((parent, name, TritonRMSNorm(child)))
            elif type(child) is SiluAndMul:
                swaps.append((parent, name, TritonSiluAndMul()))
            elif triton_matmuls and type(child) is Linear:
                swaps.append((parent, name, TritonLinear(child)))
    for parent, name, new in swaps:
        setattr(parent, name, new)
    return len(swaps)
