"""Put the arithmetic together for one (model, device, dtypes, request shape).

``make_plan`` is the only place that knows which formula feeds which: the CLI renders its
result, the ``--measured`` comparison reads its lower bounds, tests check its numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import planner.arithmetic as ar
from kvpool.kv_dtype import kv_bytes_per_token
from planner.devices import Device
from planner.dtypes import canonical_dtype, compute_dtype, dtype_bytes
from planner.models import GgufBlocks, PlannedModel
from planner.targets import Targets, plan_targets


@dataclass(frozen=True, slots=True)
class Workload:
    """The request shape to plan for.

    Attributes:
        prompt_tokens: P, tokens prefilled per request.
        output_tokens: O, tokens generated per request.
        batch: b, sequences decoding together.
        context: sequence length for the capacity and attention-intensity figures; None uses
            the model's max positions.
    """

    prompt_tokens: int = 350
    output_tokens: int = 150
    batch: int = 1
    context: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.batch < 1:
            raise ValueError("prompt tokens, output tokens and batch must be at least 1")
        if self.context is not None and self.context < 1:
            raise ValueError("context must be at least 1")


@dataclass(slots=True)
class Plan:
    """Every figure of a plan, SI units (bytes, seconds, FLOP/s). ``to_dict`` is the --json."""

    model: dict[str, Any]
    device: dict[str, Any]
    dtypes: dict[str, str]
    workload: dict[str, Any]
    ops_per_byte: float
    kv_bytes_per_token: float
    capacity: dict[str, Any]
    attention: dict[str, Any]
    prefill: dict[str, Any]
    decode: dict[str, Any]
    generation: dict[str, Any]
    cost: dict[str, Any] | None
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # With latency targets: the largest concurrency that keeps them (planner/targets.py).
    targets: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        # inf (decode never compute-bound) is not JSON; None says "never" there.
        result: dict[str, Any] = _finite(asdict(self))
        return result


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def default_dtype(device: Device) -> str:
    """The server's default: float32 on CPU, bfloat16 on GPUs (fp16 where there is no bf16)."""
    if device.name == "cpu":
        return "fp32"
    return "bf16" if "bf16" in device.peak_flops else "fp16"


def make_plan(
    model: PlannedModel,
    device: Device,
    workload: Workload,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    *,
    blocks: GgufBlocks | None = None,
    block_rows: int = 0,
    cache_bytes: int | None = None,
    targets: Targets | None = None,
) -> Plan:
    """Compute the plan.

    Args:
        model: the model config.
        device: the device (table entry with the user's overrides, or the measured CPU).
        workload: prompt/output tokens, batch, context.
        dtype: weight dtype; None is the server's default for the device.
        kv_dtype: KV cache dtype; None follows the weights (16-bit for quantized weights).
        blocks: the GGUF blocks the server reads on CPU in float32 (its default,
            ``--matmul-weights gguf``): a step of at most ``block_rows`` rows reads them
            instead of the float32 matmul weights, a larger one the float32 panels.
        block_rows: that row limit (``planner.cpu.max_quant_rows()``); 0: no blocks.
        cache_bytes: the CPU's L3 size; a note says when a step's weights fit in it.
        targets: latency targets; the plan then gives the largest concurrency that keeps
            them (planner/targets.py).
    """
    cfg = model.config
    w_dtype = canonical_dtype(dtype) if dtype else default_dtype(device)
    if kv_dtype:
        k_dtype = canonical_dtype(kv_dtype)
    else:
        k_dtype = w_dtype if w_dtype in ("fp32", "fp16", "bf16") else default_dtype(device)
    c_dtype = compute_dtype(w_dtype, device.peak_flops)
    flops_peak = device.peak_flops[c_dtype]
    bw = device.memory_bandwidth
    ratio = ar.ops_per_byte(flops_peak, bw)
    warnings: list[str] = []

    n_params = ar.param_count(cfg)
    n_streamed = ar.streamed_param_count(cfg)
    # What a token multiplies through: n_streamed but for a mixture's idle experts.
    n_active = ar.active_param_count(cfg)
    w_total = ar.weight_bytes(n_params, dtype_bytes(w_dtype))
    w_streamed = ar.weight_bytes(n_streamed, dtype_bytes(w_dtype))
    uses_blocks = blocks is not None and block_rows > 0 and device.name == "cpu"
    uses_blocks = uses_blocks and w_dtype == "fp32"

    def weights_read(body_rows: int, head_rows: int) -> float:
        """Weight bytes a step of ``body_rows`` tokens and ``head_rows`` logit rows reads:
        the GGUF blocks for the matmuls of at most ``block_rows`` rows, else float32; of a
        mixture of experts, only the experts its tokens run."""
        unread = ar.weight_bytes(ar.unread_expert_params(cfg, body_rows), dtype_bytes(w_dtype))
        if not uses_blocks:
            return w_streamed - unread
        assert blocks is not None
        saved = blocks.body_saved_bytes if body_rows <= block_rows else 0
        saved += blocks.lm_head_saved_bytes if head_rows <= block_rows else 0
        return w_streamed - unread - saved

    # int8/fp8 count their per-row scales too, as the server's pool does (kvpool/kv_dtype.py).
    k = kv_bytes_per_token(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, k_dtype, dtype_bytes(k_dtype)
    )
    L, H, d = cfg.num_layers, cfg.num_heads, cfg.head_dim
    n_in, n_out, b = workload.prompt_tokens, workload.output_tokens, workload.batch
    context = workload.context or cfg.max_position_embeddings
    if n_in + n_out > cfg.max_position_embeddings:
        warnings.append(
            f"prompt + output = {n_in + n_out} tokens exceeds the model's "
            f"{cfg.max_position_embeddings} positions"
        )

    # Capacity: the KV pool is what the weights leave of the device's memory.
    kv_tokens = ar.kv_capacity_tokens(device.memory_bytes, w_total, k)
    if w_total > device.memory_bytes:
        warnings.append(
            f"the weights ({w_total / 1e9:.2f} GB) do not fit in {device.memory_bytes / 1e9:.2f} GB"
        )
    requests_fit = ar.max_sequences(kv_tokens, n_in + n_out)
    if 0 < requests_fit < b:
        warnings.append(
            f"batch {b} needs more KV than fits: at most {requests_fit} requests of "
            f"{n_in + n_out} tokens"
        )

    # Standard attention moves activations (Q, K, V, S, P, O), which are 16-bit even when the
    # weights are int8/fp8/int4, and fp32 when the whole model runs in fp32.
    act_dtype = c_dtype if c_dtype in ("fp32", "fp16", "bf16") else "fp16"
    attn_intensity = ar.attention_intensity(context, d, dtype_bytes(act_dtype))

    # Prefill of one prompt: the TTFT lower bound.
    pf_flops = ar.prefill_flops(n_active, n_in, L, H, d)
    pf_bytes = ar.prefill_bytes(weights_read(n_in, 1), n_in, k)
    pf_time = ar.roofline_time_s(pf_bytes, pf_flops, bw, flops_peak)
    pf_intensity = ar.arithmetic_intensity(pf_flops, pf_bytes)

    # Decode at the mean context of the generation: step i (1..O) attends over P + i tokens.
    mean_ctx = n_in + (n_out + 1) / 2
    attn = ar.attention_flops_per_token(L, H, d, mean_ctx)
    dec_flops = ar.decode_step_flops(n_active, b, attn)
    w_decode = weights_read(b, b)
    dec_bytes = ar.decode_step_bytes(w_decode, b, mean_ctx, k)
    dec_time = ar.roofline_time_s(dec_bytes, dec_flops, bw, flops_peak)
    dec_intensity = ar.arithmetic_intensity(dec_flops, dec_bytes)

    # The whole batch: b prompts prefilled together, then O steps at a growing context.
    batch_pf = ar.roofline_time_s(
        ar.prefill_bytes(weights_read(b * n_in, b), b * n_in, k), b * pf_flops, bw, flops_peak
    )
    decode_total = 0.0
    for i in range(1, n_out + 1):
        ctx = n_in + i
        decode_total += ar.roofline_time_s(
            ar.decode_step_bytes(w_decode, b, ctx, k),
            ar.decode_step_flops(n_active, b, ar.attention_flops_per_token(L, H, d, ctx)),
            bw,
            flops_peak,
        )
    total = batch_pf + decode_total
    out_tps = b * n_out / total

    def step_time(batch: int, prefill: float) -> float:
        """A step of ``batch`` decodes at the mean context and ``prefill`` prompt tokens."""
        chunk = math.ceil(prefill)
        num_bytes = ar.decode_step_bytes(weights_read(batch + chunk, batch), batch, mean_ctx, k)
        flops = ar.decode_step_flops(n_active, batch, attn)
        flops += ar.prefill_flops(n_active, chunk, L, H, d)
        return ar.roofline_time_s(num_bytes + chunk * k, flops, bw, flops_peak)

    def critical_batch(attention: float, context: float, kv_token: float) -> float:
        """``ar.critical_batch_size`` at this step's weight bytes; a mixture of experts reads
        more experts as the batch grows, so its b* is the fixed point of b = b*(W(b)),
        reached from below (W grows with b, up to every expert)."""
        if not cfg.num_experts:
            return ar.critical_batch_size(ratio, w_decode, n_active, attention, context, kv_token)
        found = ar.critical_batch_size(
            ratio, weights_read(1, 1), n_active, attention, context, kv_token
        )
        for _ in range(100):
            if not math.isfinite(found):
                break
            rows = math.ceil(found)
            following = ar.critical_batch_size(
                ratio, weights_read(rows, rows), n_active, attention, context, kv_token
            )
            if following - found < 0.5:
                return following
            found = following
        return found

    targets_plan = None
    if targets is not None and targets.any:
        targets_plan = plan_targets(step_time, targets, n_in, n_out, requests_fit)

    notes: list[str] = []
    if uses_blocks:
        notes.append(
            f"weights as the server reads them by default on CPU (--matmul-weights gguf): "
            f"steps of up to {block_rows} rows read the GGUF file's blocks "
            f"({fmt_mb(weights_read(1, 1))} a step), larger ones the float32 weights "
            f"({fmt_mb(w_streamed)})"
        )
    if device.name == "cpu" and cache_bytes and cache_bytes >= w_decode:
        notes.append(
            f"the L3 cache ({fmt_mb(cache_bytes)}) is larger than the {fmt_mb(w_decode)} of "
            f"weights a decode step reads: steps may read them from cache, faster than the "
            f"{bw / 1e9:.1f} GB/s DRAM bandwidth measured, so an implied MBU above 1 is "
            "possible and the TPOT bound may be beaten"
        )

    cost: dict[str, Any] | None = None
    if device.price_per_hour is not None:
        cost = {
            "price_per_hour": device.price_per_hour,
            "per_request": ar.cost_per_request(device.price_per_hour, total, b),
            "per_million_output_tokens": ar.cost_per_million_tokens(device.price_per_hour, out_tps),
            "per_million_total_tokens": ar.cost_per_million_tokens(
                device.price_per_hour, b * (n_in + n_out) / total
            ),
        }

    return Plan(
        model={
            "name": model.name,
            "source": model.source,
            "params": n_params,
            "streamed_params": n_streamed,
            "active_params": n_active,
            "weight_bytes": w_total,
            "streamed_weight_bytes": w_streamed,
            "gguf_blocks": (
                {"path": blocks.path, "block_rows": block_rows,
                 "weight_bytes_per_small_step": weights_read(1, 1)}
                if uses_blocks and blocks is not None else None
            ),  # fmt: skip
            "num_layers": L,
            "num_heads": H,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": d,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings,
        },
        device={
            "name": device.name,
            "description": device.description,
            "memory_bandwidth": bw,
            "memory_bytes": device.memory_bytes,
            "peak_flops": flops_peak,
            "measured": device.measured,
        },
        dtypes={"weights": w_dtype, "kv": k_dtype, "compute": c_dtype},
        workload={"prompt_tokens": n_in, "output_tokens": n_out, "batch": b, "context": context},
        ops_per_byte=ratio,
        kv_bytes_per_token=k,
        capacity={
            "memory_bytes": device.memory_bytes,
            "free_bytes": max(0.0, device.memory_bytes - w_total),
            "kv_tokens": kv_tokens,
            "sequences_at_context": ar.max_sequences(kv_tokens, context),
            "requests_fit": requests_fit,
        },
        attention={
            "seq_len": context,
            "activation_dtype": act_dtype,
            "intensity": attn_intensity,
            "bound": ar.bound_by(attn_intensity, ratio),
        },
        prefill={
            "tokens": n_in,
            "flops": pf_flops,
            "bytes": pf_bytes,
            "intensity": pf_intensity,
            "memory_time_s": ar.memory_time_s(pf_bytes, bw),
            "compute_time_s": ar.compute_time_s(pf_flops, flops_peak),
            "time_s": pf_time,
            "bound": ar.bound_by(pf_intensity, ratio),
        },
        decode={
            "batch": b,
            "mean_context": mean_ctx,
            "step_bytes": dec_bytes,
            "step_flops": dec_flops,
            "intensity": dec_intensity,
            "memory_time_s": ar.memory_time_s(dec_bytes, bw),
            "compute_time_s": ar.compute_time_s(dec_flops, flops_peak),
            "time_per_token_s": dec_time,
            # The guide's rule counts every weight; GGUF blocks shrink what a step reads.
            "weights_only_time_per_token_s": ar.memory_time_s(
                w_total - (w_streamed - w_decode), bw
            ),
            "weight_bytes_per_step": w_decode,
            "output_tokens_per_s": b / dec_time,
            "bound": ar.bound_by(dec_intensity, ratio),
            "critical_batch": critical_batch(attn, mean_ctx, k),
            "critical_batch_no_kv": critical_batch(0.0, 0.0, 0.0),
        },
        generation={
            "prefill_time_s": batch_pf,
            "decode_time_s": decode_total,
            "total_time_s": total,
            "output_tokens_per_s": out_tps,
        },
        cost=cost,
        warnings=warnings,
        notes=notes,
        targets=targets_plan,
    )


def fmt_mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:,.0f} MB"
