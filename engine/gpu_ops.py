"""The elementwise parts of a decoder layer as fused Triton kernels (CUDA).

The GPU sibling of ``CpuLayerOps``: the same four ops as ``TorchLayerOps`` with the same
results (``kernels/reference.py`` holds the twins the kernels are tested against), one
kernel launch each instead of two to twelve, so a decode step launches a handful of small
kernels per layer besides its matmuls and attention. Every op is CUDA-graph safe (grid from
shapes only, no host reads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.layer_ops import TorchLayerOps

if TYPE_CHECKING:
    from engine.attention import PagedAttention
    from engine.llama import RMSNorm


class TritonLayerOps(TorchLayerOps):
    def __init__(self) -> None:
        # Imported here: Triton is loaded only when this backend is chosen.
        from kernels import rms_norm, rope_and_store, silu_mul

        self._rms_norm = rms_norm.rms_norm
        self._add_rms_norm_ = rms_norm.add_rms_norm_
        self._silu_mul = silu_mul.silu_mul
        self._rope_and_store_ = rope_and_store.rope_and_store_

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return self._rms_norm(x, norm.weight, norm.eps)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return self._add_rms_norm_(x, residual, norm.weight, norm.eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_mul(gate_up)

    def rope_and_store(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [num_tokens, 1, head_dim]
        attention: PagedAttention,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens]
        num_heads: int,
        num_kv_heads: int,
    ) -> torch.Tensor:  # rotated queries [num_tokens, num_heads, head_dim]
        cos, sin = rope
        return self._rope_and_store_(
            qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads
        )
