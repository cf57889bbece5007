"""The formulas, checked with the inference guide's worked example inputs exactly.

The guide plans Llama 2 7B in fp16 with a rounded P = 7e9 (W = 14 GB) on a T4 (300 GB/s,
65 TFLOP/s), an A10 (24 GB, 600 GB/s, 125 TFLOP/s) and an A100 80GB SXM (2,039 GB/s,
312 TFLOP/s). Where the guide rounds an intermediate figure, the test says which and shows
both numbers.
"""

from __future__ import annotations

import math

import pytest

from engine.config import ModelConfig
from planner import arithmetic as ar
from planner.models import PRESETS

GUIDE_PARAMS = 7e9
GUIDE_WEIGHT_BYTES = 2 * GUIDE_PARAMS  # fp16
GB = 1e9
# (bandwidth bytes/s, fp16 FLOP/s) per GPU of the guide
T4 = (300 * GB, 65e12)
A10 = (600 * GB, 125e12)
A100_80GB = (2039 * GB, 312e12)


def test_ops_per_byte_of_a10() -> None:
    assert ar.ops_per_byte(125e12, 600e9) == pytest.approx(208.33, abs=0.01)


def test_attention_intensity_at_4096_tokens() -> None:
    # (4N^2 d + 3N^2) / (8N^2 + 8Nd) with N = 4096, d = 128: the guide's "about 62".
    intensity = ar.attention_intensity(4096, 128, bytes_per_element=2)
    assert intensity == pytest.approx(62.42, abs=0.01)
    assert ar.bound_by(intensity, ar.ops_per_byte(125e12, 600e9)) == "memory"


def test_attention_intensity_counts_every_load_and_store() -> None:
    # By hand for N = 2, d = 1, 1-byte elements: FLOPs 4*4 + 3*4 = 28, bytes 4*4 + 4*2 = 24.
    assert ar.attention_intensity(2, 1, bytes_per_element=1) == pytest.approx(28 / 24)


def test_kv_bytes_per_token_llama_2_7b() -> None:
    assert ar.kv_bytes_per_token(32, 32, 128, 2) == 524_288


def test_kv_capacity_in_the_10_gb_left() -> None:
    free_bytes = 24 * GB - GUIDE_WEIGHT_BYTES
    assert free_bytes == pytest.approx(10 * GB)
    tokens = ar.kv_capacity_tokens(24 * GB, GUIDE_WEIGHT_BYTES, 524_288)
    # Exact division: 10e9 / 524,288 = 19,073. The guide's 19,230 divides by k rounded to
    # 0.00052 GB; the same function reproduces it when given that rounded figure.
    assert tokens == 19_073
    assert ar.kv_capacity_tokens(24 * GB, GUIDE_WEIGHT_BYTES, 0.00052 * GB) == 19_230
    assert tokens == pytest.approx(19_230, rel=0.01)
    assert ar.max_sequences(tokens, 4096) == 4
    assert ar.max_sequences(19_230, 4096) == 4


def test_kv_capacity_is_zero_when_weights_do_not_fit() -> None:
    assert ar.kv_capacity_tokens(10 * GB, 14 * GB, 524_288) == 0


@pytest.mark.parametrize(
    ("device", "guide_ms", "exact_ms"),
    [(T4, 46, 46.67), (A10, 23, 23.33), (A100_80GB, 6, 6.87)],
)
def test_decode_lower_bound_per_token(
    device: tuple[float, float], guide_ms: int, exact_ms: float
) -> None:
    bandwidth, flops = device
    step_flops = ar.decode_step_flops(GUIDE_PARAMS, batch=1)
    step_bytes = ar.decode_step_bytes(GUIDE_WEIGHT_BYTES, batch=1)
    seconds = ar.roofline_time_s(step_bytes, step_flops, bandwidth, flops)
    assert seconds * 1e3 == pytest.approx(exact_ms, abs=0.01)
    # The guide prints the milliseconds truncated: 46.67 -> 46, 23.33 -> 23, 6.87 -> 6.
    assert math.floor(seconds * 1e3) == guide_ms
    # Batch 1 decode is memory-bound by two orders of magnitude.
    assert ar.memory_time_s(step_bytes, bandwidth) > 50 * ar.compute_time_s(step_flops, flops)


@pytest.mark.parametrize(("device", "guide_ms"), [(T4, 75), (A10, 39), (A100_80GB, 16)])
def test_prefill_lower_bound_350_tokens(device: tuple[float, float], guide_ms: int) -> None:
    bandwidth, flops = device
    prefill_flops = ar.prefill_flops(GUIDE_PARAMS, 350)  # 2 * 7e9 * 350 = 4.9e12
    assert prefill_flops == pytest.approx(4.9e12)
    seconds = ar.roofline_time_s(
        ar.prefill_bytes(GUIDE_WEIGHT_BYTES, 350), prefill_flops, bandwidth, flops
    )
    assert round(seconds * 1e3) == guide_ms
    # 350 tokens are enough to make prefill compute-bound on all three.
    assert ar.arithmetic_intensity(prefill_flops, GUIDE_WEIGHT_BYTES) > ar.ops_per_byte(
        flops, bandwidth
    )


@pytest.mark.parametrize(
    ("device", "decode_ms", "guide_total_s"),
    [(T4, 46, 6.98), (A10, 23, 3.49), (A100_80GB, 6, 0.92)],
)
def test_total_generation_350_plus_150(
    device: tuple[float, float], decode_ms: int, guide_total_s: float
) -> None:
    bandwidth, flops = device
    prefill_s = ar.compute_time_s(ar.prefill_flops(GUIDE_PARAMS, 350), flops)
    # The guide adds 150 of its (truncated) per-token figures to the prefill.
    assert ar.generation_time_s(prefill_s, decode_ms / 1e3, 150) == pytest.approx(
        guide_total_s, abs=0.005
    )
    # With the exact per-token bound the same formula gives a little more: 7.08 / 3.54 / 1.05 s.
    exact = ar.generation_time_s(prefill_s, GUIDE_WEIGHT_BYTES / bandwidth, 150)
    assert guide_total_s < exact < guide_total_s * 1.15


def test_critical_batch_without_kv_is_ops_per_byte_times_half_the_bytes_per_param() -> None:
    ratio = ar.ops_per_byte(125e12, 600e9)
    b = ar.critical_batch_size(ratio, GUIDE_WEIGHT_BYTES, GUIDE_PARAMS)
    assert b == pytest.approx(ratio * 2 / 2)  # R * B_w / 2 with B_w = 2
    # At that batch the decode step's intensity equals the device's ops:byte.
    intensity = ar.arithmetic_intensity(
        ar.decode_step_flops(GUIDE_PARAMS, b), ar.decode_step_bytes(GUIDE_WEIGHT_BYTES, b)
    )
    assert intensity == pytest.approx(ratio)


def test_critical_batch_with_kv_solves_the_roofline_equation() -> None:
    ratio, context, k = 208.3, 300.0, 131_072.0  # a GQA model at a short context
    attn = ar.attention_flops_per_token(32, 32, 128, context)
    b = ar.critical_batch_size(ratio, 16e9, 8e9, attn, context, k)
    assert math.isfinite(b)
    flops = ar.decode_step_flops(8e9, b, attn)
    step_bytes = ar.decode_step_bytes(16e9, b, context, k)
    assert flops / step_bytes == pytest.approx(ratio)


def test_critical_batch_is_infinite_when_kv_reads_outgrow_flops() -> None:
    # Llama 2 7B (MHA) at 4,096 tokens: each sequence reads 2 GB of KV per step for 13 GFLOP.
    attn = ar.attention_flops_per_token(32, 32, 128, 4096)
    assert ar.critical_batch_size(208.3, 14e9, 7e9, attn, 4096, 524_288) == math.inf


def test_gqa_kv_bytes_llama_3_8b_and_int8_halves_it() -> None:
    cfg = ModelConfig.from_hf(PRESETS["llama-3-8b"])
    fp16 = ar.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2)
    int8 = ar.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1)
    assert fp16 == 131_072
    assert int8 == fp16 / 2
    # engine's own helper agrees.
    assert cfg.kv_bytes_per_token(2) == fp16


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_count_matches_engine_config(name: str) -> None:
    cfg = ModelConfig.from_hf(PRESETS[name])
    assert ar.param_count(cfg) == cfg.num_params


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("llama-2-7b", 6.738),
        ("llama-2-13b", 13.016),
        ("llama-2-70b", 68.977),
        ("llama-3-8b", 8.030),
        ("llama-3-70b", 70.554),
        ("mistral-7b", 7.242),
        ("default", 0.1345),
        # The engine's shape presets (the planner's are the same table), per-head q/k norms
        # and Gemma's extra norms left out (a few hundred thousand weights at most).
        ("llama-3.2-1b", 1.2358),
        ("qwen2.5-7b", 7.6156),
        ("qwen3-8b", 8.1907),
        ("gemma-2-9b", 9.2417),
        ("mixtral-8x7b", 46.7028),  # every expert: all of them are held in memory
        ("qwen3-30b-a3b", 30.5321),
    ],
)
def test_param_count_of_presets_matches_published_sizes(name: str, billions: float) -> None:
    assert ar.param_count(ModelConfig.from_hf(PRESETS[name])) / 1e9 == pytest.approx(
        billions, rel=1e-3
    )


def test_streamed_params_leave_out_only_an_untied_input_embedding() -> None:
    llama = ModelConfig.from_hf(PRESETS["llama-2-7b"])
    assert ar.param_count(llama) - ar.streamed_param_count(llama) == 32000 * 4096
    smol = ModelConfig.from_hf(PRESETS["default"])  # tied: the table is the LM head too
    assert ar.streamed_param_count(smol) == ar.param_count(smol)


@pytest.mark.parametrize(
    ("name", "published_active"), [("mixtral-8x7b", 12.9), ("qwen3-30b-a3b", 3.3)]
)
def test_a_mixture_runs_its_top_k_experts_a_token(name: str, published_active: float) -> None:
    """Active parameters as the model cards count them (the input embedding included)."""
    cfg = ModelConfig.from_hf(PRESETS[name])
    input_embedding = cfg.vocab_size * cfg.hidden_size
    active = ar.active_param_count(cfg) + input_embedding
    assert active / 1e9 == pytest.approx(published_active, rel=0.02)
    # One token reads exactly what it runs; a large batch reads every expert.
    streamed = ar.streamed_param_count(cfg)
    assert streamed - ar.unread_expert_params(cfg, 1) == ar.active_param_count(cfg)
    assert ar.unread_expert_params(cfg, 10_000) == pytest.approx(0, abs=1)


def test_distinct_experts_run_by_a_batch() -> None:
    assert ar.experts_run(8, 2, 1) == 2  # one token: its top-k
    assert ar.experts_run(8, 2, 4) == pytest.approx(8 * (1 - 0.75**4))  # 5.47
    assert ar.experts_run(128, 8, 256) == pytest.approx(128, rel=1e-6)
    assert ar.experts_run(0, 0, 64) == 0  # a dense model
    dense = ModelConfig.from_hf(PRESETS["llama-3-8b"])
    assert ar.active_param_count(dense) == ar.streamed_param_count(dense)
    assert ar.unread_expert_params(dense, 1) == 0


def test_prefill_flops_add_causal_attention() -> None:
    # 1 layer, 1 head, d = 1, 3 tokens: attention over 1 + 2 + 3 = 6 positions x 4 FLOPs.
    assert ar.prefill_flops(10, 3, 1, 1, 1) == 2 * 10 * 3 + 4 * 6


def test_cost_per_request_and_per_million_tokens() -> None:
    # $3.60/h is $0.001/s: a 2 s request alone costs $0.002, four sharing the device $0.0005.
    assert ar.cost_per_request(3.6, 2.0) == pytest.approx(0.002)
    assert ar.cost_per_request(3.6, 2.0, batch=4) == pytest.approx(0.0005)
    assert ar.cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)
