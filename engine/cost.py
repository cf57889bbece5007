"""StepCostModel: the bytes of weights a step reads and the FLOPs it does, from its
``SchedulerOutput``.

These are analytic figures for MBU and MFU (``server/utilization.py``, exported by
``server/metrics.py``), derived from what this runner actually executes (``engine/llama.py``),
not from the parameter count alone:

* **Decoder layers and the final norm** run on every token of the step, so every step reads
  all of their weights once, whatever the batch.
* **The embedding is a lookup**: a step reads ``num_tokens`` rows of the table, not the table
  (for Llama-3-8B the table is 1 GB of 16 GB; counting it whole would inflate MBU by 7 %).
* **The LM head runs only on the rows that need logits** (the last token of each request
  that samples this step, plus static-batch padding rows): if there is at least one such
  row it reads the whole ``[vocab, hidden]`` matrix, and if there is none (a prefill chunk
  that does not reach the end of its prompt) it reads nothing.
* With **tied embeddings** the LM head and the embedding are one tensor; the lookup's rows
  are counted besides the head's full read (they are separate kernels), a few KB.
* **Small batches may read GGUF blocks instead** (``engine/gguf_blocks.py``): a matmul of at
  most ``block_rows`` rows reads the checkpoint's quantized blocks (6 or 9 bits a weight),
  a larger one the float32 copy. ``with_blocks`` records both sizes; the layers switch on the
  step's token count, the LM head on its logit rows. **Quantized weights**
  (``--quantization``, ``engine/quantization.py``) are counted the same way: on the C++ CPU
  stack the int8 blocks (9 bits a weight) serve the same small batches; elsewhere every step
  reads the 1-byte weights and their scales (``block_rows`` unbounded).

* **A mixture of experts reads only the experts a step ran** (``engine/moe.py``): the
  layers' bytes count every expert once per layer it ran in this step (``experts_touched``,
  reported by the model), not all of them. Without that report (a step that failed and was
  re-run in parts) the bound ``min(num_tokens x top_k, num_experts)`` per layer is used.

FLOPs: ``2 x`` the matmul parameters of the decoder layers per token, ``2 x vocab x hidden``
per LM-head row, and causal attention ``4 x num_heads x head_dim x num_layers`` per
(query, key) pair (``QK^T`` and ``PV``, 2 FLOPs per multiply-add each). A chunk of ``q``
tokens after ``start`` cached ones attends to ``q * start + q (q + 1) / 2`` pairs. Norms,
RoPE, softmax, SiLU and biases are left out: they are O(hidden) per token, under 0.1 % here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from engine.config import ModelConfig


@dataclass(frozen=True, slots=True)
class StepCost:
    weight_bytes: int
    flops: int


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Per-step weight bytes and FLOPs of one model in one dtype.

    Args:
        body_weight_bytes: decoder layers (biases included) and the final norm.
        lm_head_bytes: the ``[vocab, hidden]`` output matrix.
        embedding_row_bytes: one row of the embedding table.
        body_matmul_params: weights multiplied per token in the decoder layers.
        lm_head_params: ``vocab x hidden``.
        attention_flops_per_pair: FLOPs per (query, key) pair over all layers and heads.
    """

    body_weight_bytes: int
    lm_head_bytes: int
    embedding_row_bytes: int
    body_matmul_params: int
    lm_head_params: int
    attention_flops_per_pair: int
    # Batches of 1..block_rows rows read these instead (0: no blocks attached).
    block_rows: int = 0
    body_block_bytes: int = 0
    lm_head_block_bytes: int = 0
    # A mixture of experts: one expert's bytes in one layer, the experts in all layers
    # (counted in body_weight_bytes), the mixture layers, and the experts a token runs.
    expert_bytes: int = 0
    num_experts: int = 0
    num_moe_layers: int = 0
    experts_per_token: int = 0

    def with_blocks(
        self, block_rows: int, body_saved_bytes: int, lm_head_block_bytes: int | None
    ) -> StepCostModel:
        """This model when its small batches read GGUF blocks: the layers read
        ``body_saved_bytes`` fewer bytes, the head ``lm_head_block_bytes`` (None: float32)."""
        return dataclasses.replace(
            self,
            block_rows=block_rows,
            body_block_bytes=self.body_weight_bytes - body_saved_bytes,
            lm_head_block_bytes=self.lm_head_bytes
            if lm_head_block_bytes is None
            else lm_head_block_bytes,
        )

    @classmethod
    def from_config(cls, config: ModelConfig, dtype_bytes: int) -> StepCostModel:
        h, v = config.hidden_size, config.vocab_size
        q = config.num_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        attention = h * q + 2 * h * kv + q * h
        dense = 3 * h * config.intermediate_size
        # A token runs the router and its top-k experts on a mixture layer.
        moe = h * config.num_experts + config.num_experts_per_tok * config.expert_params
        matmul_params = sum(
            attention + (moe if is_moe else dense) for is_moe in config.layer_is_moe()
        )
        embedding = v * h * (1 if config.tie_word_embeddings else 2)
        # num_params counts tied embeddings once; what is left is the layers and the norm.
        body_params = config.num_params - embedding
        return cls(
            body_weight_bytes=body_params * dtype_bytes,
            lm_head_bytes=v * h * dtype_bytes,
            embedding_row_bytes=h * dtype_bytes,
            body_matmul_params=matmul_params,
            lm_head_params=v * h,
            attention_flops_per_pair=4 * config.num_heads * config.head_dim * config.num_layers,
            expert_bytes=config.expert_params * dtype_bytes,
            num_experts=config.num_experts,
            num_moe_layers=sum(config.layer_is_moe()),
            experts_per_token=config.num_experts_per_tok,
        )

    def ridge_rows(self, bandwidth: float, flops: float, max_rows: int = 1 << 16) -> int:
        """The fewest rows at which a step of that many tokens, each with logits (as a
        verification's rows are), takes as long for its matmul FLOPs at ``flops`` FLOP/s as
        for reading its weights at ``bandwidth`` bytes/s: the roofline's ridge, below which
        the step is memory-bound. Attention and the K/V it reads are left out (both grow
        with the context, not with the rows); ``max_rows`` if no row count reaches it.
        """
        for rows in range(1, max_rows + 1):
            weight_bytes, matmul_flops, _ = self.parts(rows, rows, 0)
            if matmul_flops * bandwidth >= weight_bytes * flops:
                return rows
        return max_rows

    def step(
        self,
        chunks: Iterable[tuple[int, int]],
        num_logit_rows: int,
        experts_touched: int | None = None,
    ) -> StepCost:
        """The cost of one step.

        Args:
            chunks: ``(start, num_tokens)`` per scheduled row group: ``num_tokens`` new
                tokens at positions ``[start, start + num_tokens)`` (padding rows included).
            num_logit_rows: rows the LM head runs on (sampling rows + padding rows).
            experts_touched: a mixture's experts the step ran, summed over its layers;
                None: the bound from the token count.
        """
        num_tokens = 0
        num_pairs = 0
        for start, n in chunks:
            num_tokens += n
            num_pairs += n * start + n * (n + 1) // 2
        weight_bytes, matmul_flops, attention_flops = self.parts(
            num_tokens, num_logit_rows, num_pairs, experts_touched
        )
        return StepCost(weight_bytes=weight_bytes, flops=matmul_flops + attention_flops)

    def parts(
        self,
        num_tokens: int,
        num_logit_rows: int,
        num_pairs: int,
        experts_touched: int | None = None,
    ) -> tuple[int, int, int]:
        """A step's cost from its totals: ``(weight bytes, matmul FLOPs, attention FLOPs)``.

        Args:
            num_tokens: tokens the step computes.
            num_logit_rows: rows the LM head runs on.
            num_pairs: causal (query, key) pairs its attention computes.
            experts_touched: as in ``step``.
        """
        small = self.block_rows
        head_bytes = 0
        if num_logit_rows > 0:
            head_bytes = self.lm_head_block_bytes if num_logit_rows <= small else self.lm_head_bytes
        body_bytes = self.body_block_bytes if 0 < num_tokens <= small else self.body_weight_bytes
        if self.num_moe_layers:
            if experts_touched is None:
                per_layer = min(num_tokens * self.experts_per_token, self.num_experts)
                experts_touched = per_layer * self.num_moe_layers
            untouched = self.num_experts * self.num_moe_layers - experts_touched
            body_bytes -= untouched * self.expert_bytes
        weight_bytes = body_bytes + head_bytes + num_tokens * self.embedding_row_bytes
        matmul_flops = (
            2 * self.body_matmul_params * num_tokens + 2 * self.lm_head_params * num_logit_rows
        )
        return weight_bytes, matmul_flops, self.attention_flops_per_pair * num_pairs
