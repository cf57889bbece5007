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
        matmul_per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
        embedding = v * h * (1 if config.tie_word_embeddings else 2)
        # num_params counts tied embeddings once; what is left is the layers and the norm.
        body_params = config.num_params - embedding
        return cls(
            body_weight_bytes=body_params * dtype_bytes,
            lm_head_bytes=v * h * dtype_bytes,
            embedding_row_bytes=h * dtype_bytes,
            body_matmul_params=config.num_layers * matmul_per_layer,
            lm_head_params=v * h,
            attention_flops_per_pair=4 * config.num_heads * config.head_dim * config.num_layers,
        )

    def step(self, chunks: Iterable[tuple[int, int]], num_logit_rows: int) -> StepCost:
        """The cost of one step.

        Args:
            chunks: ``(start, num_tokens)`` per scheduled row group: ``num_tokens`` new
                tokens at positions ``[start, start + num_tokens)`` (padding rows included).
            num_logit_rows: rows the LM head runs on (sampling rows + padding rows).
        """
        num_tokens = 0
        num_pairs = 0
        for start, n in chunks:
            num_tokens += n
            num_pairs += n * start + n * (n + 1) // 2
        weight_bytes, matmul_flops, attention_flops = self.parts(
            num_tokens, num_logit_rows, num_pairs
        )
        return StepCost(weight_bytes=weight_bytes, flops=matmul_flops + attention_flops)

    def parts(self, num_tokens: int, num_logit_rows: int, num_pairs: int) -> tuple[int, int, int]:
        """A step's cost from its totals: ``(weight bytes, matmul FLOPs, attention FLOPs)``.

        Args:
            num_tokens: tokens the step computes.
            num_logit_rows: rows the LM head runs on.
            num_pairs: causal (query, key) pairs its attention computes.
        """
        small = self.block_rows
        head_bytes = 0
        if num_logit_rows > 0:
            head_bytes = self.lm_head_block_bytes if num_logit_rows <= small else self.lm_head_bytes
        body_bytes = self.body_block_bytes if 0 < num_tokens <= small else self.body_weight_bytes
        weight_bytes = body_bytes + head_bytes + num_tokens * self.embedding_row_bytes
        matmul_flops = (
            2 * self.body_matmul_params * num_tokens + 2 * self.lm_head_params * num_logit_rows
        )
        return weight_bytes, matmul_flops, self.attention_flops_per_pair * num_pairs
