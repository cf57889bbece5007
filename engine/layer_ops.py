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
    """The fused C++ kernels; falls back to the torch twin for what they do not cover.

    A step of more rows than the packed float32 panels serve (``max_packed_rows()``: 256;
    a burst of prompts prefilled together, up to the 2,048-token
    budget) runs the fused stack in passes of at most that many rows, in token order, so
    that its matmuls run on the panels rather than the library. The step keeps its shape:
    the scheduler's budget, and with it when decodes wait for prefills, is unchanged. The
    first step of 16 or 4 prompts of 128 tokens, bare engine, three alternating rounds,
    medians: AVX-512 2,490 -> 2,199 ms and 642 -> 549 ms (the panels at 256 rows: 212
    GFLOP/s over the model's matmuls here, the library at 2,048 rows: 174, and a pass's
    activations stay in cache). AVX2 builds, the library held to AVX2: passes of 64 rows
    2,600 and 618 ms, of 256 rows, which the panels serve since (the library did before),
    2,369 and 573 (``kernels/cpu/csrc/gemm.cpp``, kMaxPackedRows).
    ``rows_per_pass`` overrides that limit (tests).
    """

    fuses_layers = True
    rows_per_pass: int | None = None

    def __init__(self, ops: Any) -> None:  # torch.ops.pagedserve_cpu
        self._ops = ops
        self._panel_rows = int(ops.max_packed_rows())
        # The model's fused_weights() list and the C++ object holding the same tensors,
        # made again when the model's list is a new one (a matmul got another copy).
        self._stack_weights: tuple[list[torch.Tensor | None], Any] | None = None
        # The KV cache's lists (kvpool's KVCacheStorage owns them; they never change) and
        # the C++ object holding them.
        self._stack_caches: tuple[list[torch.Tensor], list[torch.Tensor], Any] | None = None

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

    def stack_weights(self, model: LlamaForCausalLM) -> Any:
        """``model.fused_weights()`` as the C++ stack's weights object: converted to C++ once,
        not at every step (a list of 540 optional tensors cost 0.43 ms a call to convert,
        2.7% of a batch-1 step with float32 weights, 6% with GGUF blocks)."""
        weights = model.fused_weights()
        if self._stack_weights is None or self._stack_weights[0] is not weights:
            self._stack_weights = (weights, torch.classes.pagedserve_cpu.StackWeights(weights))
        return self._stack_weights[1]

    def stack_caches(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor]) -> Any:
        """The cache lists as the C++ stack's caches object, made once: as two lists, the
        default model's 60 tensors were converted on every call."""
        held = self._stack_caches
        if held is None or held[0] is not key_caches or held[1] is not value_caches:
            obj = torch.classes.pagedserve_cpu.StackCaches(key_caches, value_caches)
            held = self._stack_caches = (key_caches, value_caches, obj)
        return held[2]

    def decoder_layers(
        self,
        model: LlamaForCausalLM,
        batch: InputBatch,
        plan: AttentionPlan,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        *,
        logits: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The embeddings of ``batch.input_ids``, then every ``layer(x, residual, ...)`` of
        ``model`` in turn, as one C++ call running the same kernels in the same order (bitwise
        the same result): on 2 cores the Python glue between a layer's kernels, then between
        layers, cost ~12% and then ~20% of a batch-1 decode step. Needs the cpu attention
        backend's per-token plan (``plan.row_block_tables``).

        Returns ``(out, residual, is_logits)``: with ``logits`` (every row is its sequence's
        last token) and a head the stack can run as the model would, ``out`` is the float32
        logits of every row (the final norm and the head ran in the call); else it is the
        last layer's output, with the residual stream.

        A step of more rows than a pass takes runs in passes over consecutive rows.
        NOTE: that is exact attention, as chunked prefill is: every row attends through its
        own block table row and context length, a sequence's rows are consecutive and in
        position order, and a pass writes its rows' K/V of every layer before the next pass
        reads them::

            rows:    | d0 d1 d2 | p0 p0 p0 p0 p0 p0 | p1 p1 p1 p1 |
            passes:  |<------- pass 0 ------->|<---- pass 1 ---->|
                      p0's last two rows (pass 1) read its first four from the cache.
        """
        layer = model.layers[0]
        eps = layer.input_norm.eps
        # The stack's head is the model's when it norms with the layers' eps and the head
        # has its packed copy (then both run the same C++ linear).
        logits = logits and model.norm.eps == eps and model.lm_head.packed is not None
        weights = self.stack_weights(model)
        caches = self.stack_caches(key_caches, value_caches)
        assert plan.row_block_tables is not None and plan.row_seq_lens is not None
        args = (
            batch.input_ids,
            batch.positions,
            batch.slot_mapping,
            plan.row_block_tables,
            plan.row_seq_lens,
        )
        t = batch.input_ids.shape[0]
        rows = self.rows_per_pass or self._panel_rows
        # One pass (every decode step): the step's own tensors, no slicing.
        if t <= rows:
            spans = [args]
        else:
            spans = [tuple(a[i : i + rows] for a in args) for i in range(0, t, rows)]
        passes = [
            self._ops.decoder_layers(
                ids,
                positions,
                weights,
                caches,
                model.rope.cos,
                model.rope.sin,
                slots,
                tables,
                lens,
                layer.num_heads,
                layer.num_kv_heads,
                eps,
                model.attention.scale,
                logits,
            )
            for ids, positions, slots, tables, lens in spans
        ]
        if len(passes) == 1:
            return passes[0][0], passes[0][1], logits
        out = torch.cat([o for o, _ in passes])
        return out, torch.cat([res for _, res in passes]), logits
