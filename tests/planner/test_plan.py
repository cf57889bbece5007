"""The worked example end to end: the llama-2-7b preset through ``make_plan``.

The preset has the real parameter count (6.74e9, of which 6.61e9 are read per decode step)
and the plan counts KV reads and attention FLOPs, so its figures sit a few percent below
the guide's rounded ones: tolerances say how far.
"""

from __future__ import annotations

import math

import pytest

from planner.devices import Device, get_device, with_overrides
from planner.models import load_model
from planner.plan import Workload, make_plan
from planner.report import render_plan

LLAMA_2_7B = load_model("llama-2-7b")


@pytest.mark.parametrize(
    ("device", "decode_ms", "prefill_ms", "total_s"),
    # The guide's figures before it rounds them: 46.7 / 23.3 / 6.87 ms, 75.4 / 39.2 / 15.7 ms.
    [("t4", 46.7, 75.4, 6.98), ("a10", 23.3, 39.2, 3.49), ("a100-80gb", 6.87, 15.7, 0.92)],
)
def test_guide_figures_from_the_preset(
    device: str, decode_ms: float, prefill_ms: float, total_s: float
) -> None:
    plan = make_plan(LLAMA_2_7B, get_device(device), Workload(350, 150, 1), dtype="fp16")
    # 6.61e9 streamed parameters instead of 7e9: 5.6 % less, plus a little KV and attention.
    assert plan.decode["time_per_token_s"] * 1e3 == pytest.approx(decode_ms, rel=0.06)
    assert plan.prefill["time_s"] * 1e3 == pytest.approx(prefill_ms, rel=0.06)
    # The guide's totals add its truncated per-token times (6 ms for 6.87 on the A100).
    assert plan.generation["total_time_s"] == pytest.approx(total_s, rel=0.10)
    assert plan.decode["bound"] == "memory"
    assert plan.prefill["bound"] == "compute"
    # The guide's own rule (all weights over bandwidth) with the real parameter count.
    assert plan.decode["weights_only_time_per_token_s"] == pytest.approx(
        2 * 6.738e9 / get_device(device).memory_bandwidth, rel=1e-3
    )


def test_a10_capacity_and_ratios_from_the_preset() -> None:
    plan = make_plan(LLAMA_2_7B, get_device("a10"), Workload(context=4096), dtype="fp16")
    assert plan.ops_per_byte == pytest.approx(208.3, abs=0.05)
    assert plan.kv_bytes_per_token == 524_288
    assert plan.attention["intensity"] == pytest.approx(62.4, abs=0.05)
    assert plan.attention["bound"] == "memory"
    # 24 GB - 13.48 GB = 10.52 GB: a little more room than the guide's 10 GB.
    assert plan.capacity["kv_tokens"] == math.floor((24e9 - 2 * 6_738_415_616) / 524_288)
    assert plan.capacity["kv_tokens"] == pytest.approx(19_230, rel=0.05)
    assert plan.capacity["sequences_at_context"] == 4
    assert plan.decode["critical_batch_no_kv"] == pytest.approx(208.3, abs=0.05)
    # MHA at ~425 tokens of context: KV reads per sequence outgrow its FLOPs.
    assert plan.decode["critical_batch"] == math.inf
    assert plan.to_dict()["decode"]["critical_batch"] is None  # JSON has no infinity


def test_gqa_and_int8_kv_in_a_plan() -> None:
    llama3 = load_model("llama-3-8b")
    fp16 = make_plan(llama3, get_device("a100-80gb"), Workload(), dtype="bf16", kv_dtype="fp16")
    int8 = make_plan(llama3, get_device("a100-80gb"), Workload(), dtype="bf16", kv_dtype="int8")
    assert fp16.kv_bytes_per_token == 131_072
    # one byte per element plus a float16 scale per (token, KV head) row of K and of V, as
    # the server's pool stores them: 2 * 32 layers * 8 heads * (128 + 2)
    assert int8.kv_bytes_per_token == 66_560
    ratio = 131_072 / 66_560  # 1.97x the tokens
    assert int8.capacity["kv_tokens"] == pytest.approx(ratio * fp16.capacity["kv_tokens"], abs=1)
    assert int8.dtypes == {"weights": "bf16", "kv": "int8", "compute": "bf16"}


def test_batching_amortises_weights_until_the_critical_batch() -> None:
    model, device = load_model("llama-3-8b"), get_device("h100-sxm")
    times = {b: make_plan(model, device, Workload(128, 128, b)).decode for b in (1, 64, 4096)}
    # Batch 64 costs barely more per step than batch 1: the weights dominate the bytes.
    assert times[64]["time_per_token_s"] < 1.3 * times[1]["time_per_token_s"]
    assert times[64]["output_tokens_per_s"] > 40 * times[1]["output_tokens_per_s"]
    assert times[1]["bound"] == "memory"
    assert times[4096]["bound"] == "compute"
    assert 64 < times[1]["critical_batch"] < 4096


def test_default_dtype_and_quantized_weights() -> None:
    model = load_model("default")
    assert make_plan(model, get_device("a10"), Workload()).dtypes["weights"] == "bf16"
    assert make_plan(model, get_device("t4"), Workload()).dtypes["weights"] == "fp16"
    # int4 weights on an A100: dequantized to bf16 for the matmuls, 16-bit KV by default.
    q4 = make_plan(model, get_device("a100-40gb"), Workload(), dtype="int4")
    assert q4.dtypes == {"weights": "int4", "kv": "bf16", "compute": "bf16"}
    assert q4.model["weight_bytes"] == pytest.approx(q4.model["params"] * 0.5)
    # fp8 on an H100 runs on fp8 tensor cores.
    fp8 = make_plan(model, get_device("h100-sxm"), Workload(), dtype="fp8")
    assert fp8.device["peak_flops"] == pytest.approx(1978.9e12)
    with pytest.raises(ValueError, match="bf16"):
        make_plan(model, get_device("t4"), Workload(), dtype="bf16")


def test_warnings_and_cost() -> None:
    plan = make_plan(
        load_model("llama-2-70b"), get_device("a10"), Workload(4000, 200), dtype="fp16"
    )
    joined = " ".join(plan.warnings)
    assert "do not fit" in joined and "exceeds" in joined
    assert plan.capacity["kv_tokens"] == 0
    priced = make_plan(
        LLAMA_2_7B,
        with_overrides(get_device("a10"), price_per_hour=3.6),
        Workload(350, 150, 1),
        dtype="fp16",
    )
    assert priced.cost is not None
    total = priced.generation["total_time_s"]
    assert priced.cost["per_request"] == pytest.approx(0.001 * total)
    assert priced.cost["per_million_output_tokens"] == pytest.approx(0.001 * total / 150 * 1e6)


def test_gguf_blocks_serve_steps_up_to_the_row_limit_and_float32_above() -> None:
    from planner.models import GgufBlocks

    model = load_model("default")
    device = Device("cpu", "test", 20e9, 16e9, {"fp32": 100e9, "bf16": 50e9}, measured=True)
    # 100 MB of layer matmuls and the 10 MB head on blocks instead of 400 + 40 MB.
    blocks = GgufBlocks("x.gguf", 100_000_000, 400_000_000, 10_000_000, 40_000_000)
    f32 = make_plan(model, device, Workload(batch=8))
    small = make_plan(model, device, Workload(batch=8), blocks=blocks, block_rows=8)
    large = make_plan(model, device, Workload(batch=9), blocks=blocks, block_rows=8)
    w = f32.model["streamed_weight_bytes"]
    assert f32.decode["weight_bytes_per_step"] == w
    assert small.decode["weight_bytes_per_step"] == w - 300_000_000 - 30_000_000
    assert large.decode["weight_bytes_per_step"] == w
    assert small.decode["memory_time_s"] < f32.decode["memory_time_s"]
    # Blocks are a float32 CPU path: not for bf16 weights, nor a GPU.
    bf16 = make_plan(model, device, Workload(batch=8), "bf16", blocks=blocks, block_rows=8)
    assert bf16.model["gguf_blocks"] is None and not bf16.notes


def test_a_note_when_the_l3_cache_holds_what_a_step_reads() -> None:
    model = load_model("default")
    device = Device("cpu", "test", 20e9, 16e9, {"fp32": 100e9}, measured=True)
    w = make_plan(model, device, Workload()).decode["weight_bytes_per_step"]
    big = make_plan(model, device, Workload(), cache_bytes=int(w) + 1)
    assert any("L3 cache" in note and "MBU above 1" in note for note in big.notes)
    assert not make_plan(model, device, Workload(), cache_bytes=int(w) - 1).notes
    assert "notes" in render_plan(big) and "L3 cache" in render_plan(big)


def test_rows_never_run_into_each_other() -> None:
    """A value wider than its column keeps two spaces before the formula (it used to read
    "453.09 ms (compute ...)max(bytes / BW, ...")."""
    plan = make_plan(
        load_model("llama-2-7b"), get_device("a10"), Workload(prompt_tokens=4000, batch=64)
    )
    for line in render_plan(plan).splitlines():
        assert ")max(" not in line and ")at context" not in line, line
    from planner.report import _row

    assert _row("x" * 40, "y" * 50, "formula") == "  " + "x" * 40 + "  " + "y" * 50 + "  formula"


def test_a_mixture_of_experts_is_held_whole_and_read_by_the_experts_a_step_runs() -> None:
    """Mixtral 8x7B in bf16: all 46.7e9 weights must fit (93 GB: not one 80 GB H100), while a
    batch-1 decode step reads only its two experts a layer (12.7e9 weights) and multiplies
    through the same; a large batch reads every expert."""
    mixtral = load_model("mixtral-8x7b")
    h100 = get_device("h100-sxm")
    one = make_plan(mixtral, h100, Workload(128, 128, 1), dtype="bf16")
    assert one.model["weight_bytes"] == pytest.approx(2 * 46.7028e9, rel=1e-4)
    assert any("do not fit" in w for w in one.warnings)
    active = one.model["active_params"]
    assert active / 1e9 == pytest.approx(12.749, rel=1e-3)
    assert one.decode["weight_bytes_per_step"] == pytest.approx(2 * active)
    # 2 FLOPs a weight it runs, and a little attention at a context of ~192 tokens.
    assert one.decode["step_flops"] == pytest.approx(2 * active, rel=0.01)
    assert "a token runs" in render_plan(one)
    big = make_plan(mixtral, get_device("h200"), Workload(128, 128, 256), dtype="bf16")
    assert not any("do not fit" in w for w in big.warnings)  # 141 GB
    streamed = big.model["streamed_params"]
    assert big.decode["weight_bytes_per_step"] == pytest.approx(2 * streamed, rel=1e-6)
    # Compute-bound only once a batch reads every expert: b* = R x W_all / (2 P_active),
    # 3.7x a dense model's R (the fixed point of b = b*(W(b)); W at b = 1 would say 206).
    ratio = big.ops_per_byte
    assert big.decode["critical_batch_no_kv"] == pytest.approx(ratio * streamed / active, rel=1e-3)
    # FLOPs count the experts each token runs, at any batch.
    dense_part = 2 * active * 256
    assert big.decode["step_flops"] >= dense_part
    assert big.decode["step_flops"] < 2 * streamed * 256


def test_the_planner_plans_every_preset_the_server_serves() -> None:
    """One table of presets (engine/presets.py): each name ``--load-format dummy`` serves is
    a name ``pagedserve plan`` plans, as the same config."""
    from engine.config import ModelConfig
    from engine.presets import PRESETS as SERVED

    for name, hf_config in SERVED.items():
        planned = load_model(name)
        assert planned.config == ModelConfig.from_hf(hf_config), name
        plan = make_plan(planned, get_device("h100-sxm"), Workload(128, 128, 8), dtype="bf16")
        assert plan.decode["time_per_token_s"] > 0, name
