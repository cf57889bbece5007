"""The elementwise parts of a decoder layer, over one of two implementations.

- ``TorchLayerOps``: plain PyTorch (any device, any dtype; the oracle).
- ``CpuLayerOps``: the fused C++ kernels of ``kernels.cpu`` (CPU, float32): RMSNorm with its
  residual add, SiLU-times-up, and RoPE with the K/V cache write, one op each instead of
  two to eight. At decode batch sizes on a CPU, per-op dispatch and thread wake-up cost as
  much as the arithmetic.

Both keep the residual stream the same way: ``add_rms_norm_`` adds a sublayer's output into
``residual`` in place and returns the normed sum, which is exactly ``x = x + sublayer(...)``
followed by the norm, in the same float32 operations order for the torch twin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from engine.rope import apply_rope

if TYPE_CHECKING:
    from engine.attention import AttentionPlan, PagedAttention
    from engine.input_batch import InputBatch
    from engine.llama import LlamaForCausalLM, RMSNorm


class TorchLayerOps:
    # Whether decoder_layers exists: every decoder layer of a step in one call.
    fuses_layers = False

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        residual.add_(x)
        return norm(residual)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

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
        t, head_dim = qkv.shape[0], key_cache.shape[-1]
        qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], -1)
        cos, sin = rope
        # Q and K heads rotate together: one set of elementwise ops instead of two.
        qk = apply_rope(qk.view(t, num_heads + num_kv_heads, head_dim), cos, sin)
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        # The chunk's own K/V must be in the cache before attention: its queries attend to
        # them through the block table like to any cached token.
        attention.store(k, v.view(t, num_kv_heads, head_dim), key_cache, value_cache, slot_mapping)
        return q


class CpuLayerOps(TorchLayerOps):
    """The fused C++ kernels; falls back to the torch twin for what they do not cover."""

    fuses_layers = True

    def __init__(self, ops: Any) -> None:  # torch.ops.pagedserve_cpu
        self._ops = ops

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return self._ops.rms_norm(x.contiguous(), norm.weight, norm.eps)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return self._ops.add_rms_norm_(x.contiguous(), residual, norm.weight, norm.eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_mul(gate_up)

    def rope_and_store(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attention: PagedAttention,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> torch.Tensor:
        t, head_dim = qkv.shape[0], key_cache.shape[-1]
        cos, sin = rope
        self._ops.rope_and_store_(
            qkv,
            cos.view(t, head_dim),
            sin.view(t, head_dim),
            key_cache,
            value_cache,
            slot_mapping,
            num_heads,
            num_kv_heads,
        )
        return qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)

    def decoder_layers(
        self,
        model: LlamaForCausalLM,
        x: torch.Tensor,  # [num_tokens, hidden]: the embeddings
        batch: InputBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every ``layer(x, residual, ...)`` of ``model`` in turn, as one C++ call running
        the same kernels in the same order (bitwise the same result): on 2 cores the Python
        glue between a layer's kernels, then between layers, cost ~12% and then ~20% of a
        batch-1 decode step. Needs the cpu attention backend's per-token plan
        (``plan.row_block_tables``). Returns the last layer's (output, residual stream)."""
        layer = model.layers[0]
        t, head_dim = x.shape[0], layer.head_dim
        cos, sin = rope
        return self._ops.decoder_layers(
            x,
            model.fused_weights(),
            key_caches,
            value_caches,
            cos.view(t, head_dim),
            sin.view(t, head_dim),
            batch.slot_mapping,
            plan.row_block_tables,
            plan.row_seq_lens,
            layer.num_heads,
            layer.num_kv_heads,
            layer.input_norm.eps,
            model.attention.scale,
        )
