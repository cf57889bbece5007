"""StepCostModel against a real Llama module's parameters, and its per-step arithmetic."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import ModelConfig
from engine.cost import StepCostModel


def _hf(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):  # shapes only: no memory, no init time
        return LlamaForCausalLM(config)


@pytest.mark.parametrize("tied", [True, False])
def test_weight_split_matches_the_module(tied: bool) -> None:
    hf = _hf(tied)
    cost = StepCostModel.from_config(ModelConfig.from_hf(hf.config), dtype_bytes=4)
    head = hf.lm_head.weight
    embed = hf.model.embed_tokens.weight
    body = [p for p in hf.parameters() if p is not head and p is not embed]
    assert cost.body_weight_bytes == 4 * sum(p.numel() for p in body)
    assert cost.lm_head_bytes == 4 * head.numel()
    assert cost.embedding_row_bytes == 4 * embed.shape[1]
    matmul = [p for p in hf.model.layers.parameters() if p.dim() == 2]
    assert cost.body_matmul_params == sum(p.numel() for p in matmul)


def test_step_arithmetic() -> None:
    cost = StepCostModel.from_config(ModelConfig.from_hf(_hf(True).config), dtype_bytes=2)
    per_pair = 4 * 4 * 16 * 3  # 4 x heads x head_dim x layers
    assert cost.attention_flops_per_pair == per_pair
    # Batch-1 decode at position 9: one token attends to 10 keys; the head runs on one row.
    decode = cost.step([(9, 1)], num_logit_rows=1)
    assert decode.weight_bytes == cost.body_weight_bytes + cost.lm_head_bytes + 2 * 64
    assert decode.flops == 2 * cost.body_matmul_params + 2 * 320 * 64 + per_pair * 10
    # A prefill chunk that does not reach the end of its prompt samples nothing: no head.
    # Positions 4..7 after 4 cached ones attend to 5+6+7+8 = 4*4 + 4*5/2 = 26 keys.
    chunk = cost.step([(4, 4)], num_logit_rows=0)
    assert chunk.weight_bytes == cost.body_weight_bytes + 4 * 2 * 64
    assert chunk.flops == 2 * cost.body_matmul_params * 4 + per_pair * 26
