"""The CUDA backend's layer ops: the model's norms and SiLU-times-up as fused Triton kernels.

``fuse_layer_ops`` replaces, from outside, every ``RMSNorm`` of a loaded model with a
``TritonRMSNorm`` and every ``SiluAndMul`` with a ``TritonSiluAndMul`` holding the same weight
tensors: one launch each (``add_norm_`` adds the residual in the same launch) instead of
the four to eight elementwise kernels the plain ops take in bf16. RoPE fused with the K/V
store comes with the Triton attention backend (``PagedAttention.rope_and_store``). With them
a decoder layer launches four small kernels besides its matmuls and attention. Each op's
result is the plain op's (``kernels/reference.py`` holds the twins the kernels are tested
against), and every launch is CUDA-graph safe: grids from shapes only, no host reads.

Imports Triton: the builder imports this module only for a CUDA engine. The decode steps'
CUDA graphs (``engine/cuda_graphs.py``) replay the model after this.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.llama import RMSNorm, SiluAndMul
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


def fuse_layer_ops(model: nn.Module) -> int:
    """Swap the model's norms and activations for their Triton versions, in place; returns
    how many modules were replaced."""
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is RMSNorm:
                swaps.append((parent, name, TritonRMSNorm(child)))
            elif type(child) is SiluAndMul:
                swaps.append((parent, name, TritonSiluAndMul()))
    for parent, name, new in swaps:
        setattr(parent, name, new)
    return len(swaps)
