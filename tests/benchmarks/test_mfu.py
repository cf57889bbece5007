"""Model FLOPs arithmetic of benchmarks.mfu, checked against hand counts."""

from __future__ import annotations

import pytest

from benchmarks.mfu import achieved_flops_s, add_mfu, layer_matmuls, request_flops
from engine.config import ModelConfig
from engine.cost import StepCostModel

# SmolLM2-135M's config.json (the embedded default model).
SMOLLM2 = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
}
# 1 layer, hidden 4, 2 heads of 2, 1 KV head, MLP 3, vocabulary 5: small enough to count.
TINY_CONFIG = ModelConfig.from_hf(
    {
        "num_hidden_layers": 1,
        "hidden_size": 4,
        "intermediate_size": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 2,
        "vocab_size": 5,
    }
)
TINY = StepCostModel.from_config(TINY_CONFIG, dtype_bytes=4)


def test_smollm2_matmul_shapes_match_pagedserve_fused_weights() -> None:
    config = ModelConfig.from_hf(SMOLLM2)
    assert layer_matmuls(config) == [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    cost = StepCostModel.from_config(config, dtype_bytes=4)
    assert cost.lm_head_params == 576 * 49152
    assert cost.body_matmul_params == 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    config = {k: v for k, v in SMOLLM2.items() if k not in ("head_dim", "num_key_value_heads")}
    shapes = ModelConfig.from_hf(config)
    assert shapes.head_dim == 64
    assert shapes.num_kv_heads == 9


def test_request_flops_by_hand() -> None:
    # Layer matmuls: qkv 4x(2+2)*2=4x8, o 4x4, gate_up 4x6, down 3x4 -> 32+16+24+12 = 84.
    assert TINY.body_matmul_params == 84
    assert sum(i * o for i, o in layer_matmuls(TINY_CONFIG)) == 84
    # P=2, O=3: 4 tokens through the layer, 3 through the lm_head (4x5 = 20 weights),
    # attention at t = 1..4 positions: 4 * 1 layer * 2 heads * 2 dims * (1+2+3+4) = 160.
    expected = 2 * 4 * 84 + 2 * 3 * 20 + 160
    assert request_flops(TINY, 2, 3) == expected


def test_achieved_flops_s_and_mfu() -> None:
    per_request = request_flops(TINY, 2, 3)
    assert achieved_flops_s(TINY, 10, 2, 3, duration_s=4.0) == pytest.approx(10 * per_request / 4)
    assert achieved_flops_s(TINY, 0, 2, 3, duration_s=4.0) == 0.0
    points = {
        "1": {
            "num_completed": 10,
            "mean_prompt_tokens": 2,
            "mean_output_tokens": 3,
            "duration_s": 4.0,
        },
        "16": {
            "num_completed": 10,
            "mean_prompt_tokens": 2,
            "mean_output_tokens": 3,
            "duration_s": 4.0,
        },
        "64": {"num_completed": 0},
    }
    add_mfu(points, TINY, {"16": per_request, "64": 1.0})
    assert "mfu" not in points["1"]  # no ceiling measured at 1 row
    assert points["16"]["mfu"] == pytest.approx(10 / 4)
    assert "mfu" not in points["64"]  # nothing completed


def test_matmul_ceiling_counts_pagedserves_own_kernels_where_they_serve() -> None:
    """The ceiling is the best of the library's two layouts and, where the C++ kernels
    build and serve that many rows, the float32 panels and the GGUF blocks: a ceiling
    below what the server's own matmuls reach would report an MFU over 100%."""
    from benchmarks.mfu import measure_matmul_ceiling
    from kernels import cpu as cpu_kernels

    config = ModelConfig.from_hf(
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": 256,
        }
    )
    m = measure_matmul_ceiling(config, 4, min_repeats=1, budget_s=0.0)
    ops = cpu_kernels.load()
    expected = {"x_at_w", "f_linear", "ceiling"}
    if ops is not None:
        expected |= {"panels", "blocks"}
    assert set(m) == expected
    assert m["ceiling"] == max(v for k, v in m.items() if k != "ceiling")
    assert all(v > 0 for v in m.values())
    if ops is not None:  # past the GGUF blocks' rows, only the panels join the library
        rows = ops.max_quant_rows() + 1
        assert "blocks" not in measure_matmul_ceiling(config, rows, min_repeats=1, budget_s=0.0)
