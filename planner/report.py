"""Render a plan (and its comparisons with measurements) as a readable text table."""

from __future__ import annotations

import math
from typing import Any

from planner.compare import ComparisonRow
from planner.measured import Measured
from planner.plan import Plan

_LABEL_WIDTH = 33
_VALUE_WIDTH = 44


def fmt_bytes(n: float) -> str:
    """Decimal units, like the device table: 13.48 GB, 524.29 kB (and the exact count if small)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def fmt_flops(f: float) -> str:
    return f"{f / 1e12:.2f} TFLOP/s" if f >= 1e12 else f"{f / 1e9:.1f} GFLOP/s"


def fmt_count(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:.1f} M"
    return f"{n:,.0f}"


def _row(label: str, value: str, formula: str = "") -> str:
    """One ``label  value  formula`` row; a label or value wider than its column keeps two
    spaces before the next one rather than running into it."""
    label_cell = f"{label:<{_LABEL_WIDTH - 2}}  "
    value_cell = f"{value:<{_VALUE_WIDTH - 2}}  "
    return f"  {label_cell}{value_cell}{formula}".rstrip()


def render_plan(plan: Plan) -> str:
    """The plan as sections of ``label  value  formula`` rows."""
    m, dev, dt, w = plan.model, plan.device, plan.dtypes, plan.workload
    cap, att, pf, dec, gen = (
        plan.capacity,
        plan.attention,
        plan.prefill,
        plan.decode,
        plan.generation,
    )
    n_in, n_out, b = w["prompt_tokens"], w["output_tokens"], w["batch"]
    lines = [
        f"pagedserve plan: {m['name']} ({m['source']}) on {dev['name']}: {dev['description']}",
        f"weights {dt['weights']}, KV cache {dt['kv']}, matmuls {dt['compute']}; "
        f"prompt {n_in} + output {n_out} tokens, batch {b}",
        "",
        "model",
        _row(
            "parameters",
            f"{fmt_count(m['params'])} ({fmt_count(m['streamed_params'])} read per step)",
            "P; minus untied input embedding",
        )
        if m["active_params"] == m["streamed_params"]
        else _row(
            "parameters",
            f"{fmt_count(m['params'])} ({fmt_count(m['active_params'])} a token runs, "
            f"up to {fmt_count(m['streamed_params'])} a step reads)",
            "P; top-k experts; all experts",
        ),
        _row(
            "layers / heads / KV heads / d",
            f"{m['num_layers']} / {m['num_heads']} / {m['num_kv_heads']} / {m['head_dim']}",
        ),
        _row("weights", fmt_bytes(m["weight_bytes"]), "W = P x bytes/param"),
        _row(
            "KV cache per token",
            f"{plan.kv_bytes_per_token:,.0f} B",
            "k = 2 x L x H_kv x d x bytes",
        ),
        "",
        "device" + (" (measured)" if dev["measured"] else ""),
        _row("memory bandwidth", f"{dev['memory_bandwidth'] / 1e9:,.1f} GB/s", "BW"),
        _row(f"peak {dt['compute']} (dense)", fmt_flops(dev["peak_flops"]), "F"),
        _row("ops:byte", f"{plan.ops_per_byte:.1f}", "R = F / BW"),
        _row("memory", fmt_bytes(dev["memory_bytes"]), "M"),
        "",
        "capacity",
        _row("free for KV cache", fmt_bytes(cap["free_bytes"]), "M - W"),
        _row("KV tokens", f"{cap['kv_tokens']:,}", "floor((M - W) / k)"),
        _row(
            f"sequences of {w['context']:,} tokens",
            f"{cap['sequences_at_context']:,}",
            "floor(tokens / context)",
        ),
        _row(
            f"requests of {n_in + n_out:,} tokens",
            f"{cap['requests_fit']:,}",
            "floor(tokens / (P + O))",
        ),
        "",
        "arithmetic intensity (FLOP/byte) vs ops:byte",
        _row(
            f"attention N={att['seq_len']} d={m['head_dim']}",
            f"{att['intensity']:.1f} -> {att['bound']}-bound",
            "(4N^2 d + 3N^2) / (bytes x (4N^2 + 4Nd))",
        ),
        _row(
            f"decode, batch {b}",
            f"{dec['intensity']:.2f} -> {dec['bound']}-bound",
            "b(2P + A) / (W + b c k)",
        ),
        _row(
            f"prefill, {n_in} tokens",
            f"{pf['intensity']:.1f} -> {pf['bound']}-bound",
            "(2Pn + A) / (W + n k)",
        ),
        _row("critical batch (decode)", _critical(dec), "b* = R W / (2P + A - R c k)"),
        "",
        "lower bounds",
        _row(
            f"prefill {n_in} tokens (TTFT)",
            f"{fmt_time(pf['time_s'])} (compute "
            f"{fmt_time(pf['compute_time_s'])}, memory {fmt_time(pf['memory_time_s'])})",
            "max(bytes / BW, FLOPs / F)",
        ),
        _row(
            f"decode per token (TPOT), b={b}",
            f"{fmt_time(dec['time_per_token_s'])} "
            f"(memory {fmt_time(dec['memory_time_s'])}, compute "
            f"{fmt_time(dec['compute_time_s'])})",
            f"at context {dec['mean_context']:g}",
        ),
        _row(
            "  weights only (guide's rule)",
            fmt_time(dec["weights_only_time_per_token_s"]),
            "W / BW",
        ),
        _row(
            f"  weights read per step, b={b}",
            fmt_bytes(dec["weight_bytes_per_step"]),
            "W_s (GGUF blocks up to the row limit)" if m.get("gguf_blocks") else "W_s",
        ),
        _row(
            f"decode throughput, b={b}", f"{dec['output_tokens_per_s']:,.1f} tok/s", "b / t_decode"
        ),
        _row(
            f"{n_in} + {n_out} tokens, batch {b}",
            f"{fmt_time(gen['total_time_s'])} ({gen['output_tokens_per_s']:,.1f} output tok/s)",
            "t_prefill + sum of O decode steps",
        ),
    ]
    if plan.targets is not None:
        lines += ["", *_targets_lines(plan.targets, n_in, n_out)]
    if plan.cost is not None:
        c = plan.cost
        lines += [
            "",
            f"cost at ${c['price_per_hour']:.2f}/h (example price; --price-per-hour)",
            _row("per request", f"${c['per_request']:.6f}", "price/3600 x t / b"),
            _row("per 1M output tokens", f"${c['per_million_output_tokens']:.2f}"),
            _row("per 1M prompt + output tokens", f"${c['per_million_total_tokens']:.2f}"),
        ]
    if plan.notes:
        lines += ["", "notes", *(f"  - {note}" for note in plan.notes)]
    if plan.warnings:
        lines += ["", "warnings", *(f"  ! {warning}" for warning in plan.warnings)]
    return "\n".join(lines)


def _targets_lines(targets: dict[str, Any], n_in: int, n_out: int) -> list[str]:
    set_ = targets["targets"]
    named = ", ".join(
        f"{name} {fmt_time(set_[key])}"
        for name, key in (("ITL", "itl_s"), ("TPOT", "tpot_s"), ("TTFT", "ttft_s"))
        if set_[key] is not None
    )
    ratio = set_.get("itl_ratio")
    if ratio is not None:
        named = ", ".join(filter(None, (named, f"ITL ratio {ratio:g}x")))
    lines = [f"latency targets ({named}), steady state: each step also prefills b x P / O tokens"]
    best, at = targets["max_concurrency"], targets["at_max"]
    if not best or at is None:
        lines.append(_row("largest concurrency", "none", "even b=1 misses a target"))
        return lines
    cap = {"memory": " (KV memory caps it)", "none": ""}.get(targets["limited_by"], "")
    lines += [
        _row("largest concurrency", f"{best:,}{cap}", "largest b with every target kept"),
        _row(f"  step time = ITL = TPOT, b={best}", fmt_time(at["step_time_s"]),
             f"roofline of b decodes + {at['prefill_tokens_per_step']:,.1f} prompt tokens"),
        *([_row(f"  the same decodes alone, b={best}", fmt_time(at["decode_step_s"]),
                f"t_step / t_decodes = {at['step_time_s'] / at['decode_step_s']:.2f}x "
                f"(target {ratio:g}x)")] if ratio is not None else []),
        _row(f"  TTFT, b={best}", fmt_time(at["ttft_s"]), "ceil(P / (b P / O)) x t_step"),
        _row(f"  output throughput, b={best}", f"{at['output_tokens_per_s']:,.1f} tok/s",
             "b / t_step"),
    ]  # fmt: skip
    return lines


def render_targets_measured(check: dict[str, Any]) -> str:
    """Whether a measured point kept the targets."""

    def word(held: bool | None) -> str:
        return "no figure" if held is None else ("held" if held else "missed")

    held = ", ".join(f"{_TARGET_NAMES[name]} {word(v)}" for name, v in check["held"].items())
    c = check["concurrency"]
    figures = [f"TPOT {fmt_time(check['tpot_s'])}", f"TTFT {fmt_time(check['ttft_s'])}"]
    if "itl" in check["held"]:
        if check["itl_from"] == "itl_p99":
            figures.insert(0, f"ITL p99 {fmt_time(check['itl_p99_s'])}")
        else:
            figures.append("no ITL p99 in the measurement, so the TPOT stands for the ITL")
    if "itl_ratio" in check["held"]:
        if check["itl_ratio"] is not None:
            figures.insert(0, f"ITL p99 / p50 {check['itl_ratio']:.2f}x")
        else:
            figures.append("no ITL p99 and p50 in the measurement for the ratio")
    return (
        f"  latency targets at the measured concurrency {c if c is not None else '?'}: {held} "
        f"({', '.join(figures)})"
    )


_TARGET_NAMES = {"itl": "ITL", "itl_ratio": "ITL ratio", "tpot": "TPOT", "ttft": "TTFT"}


def render_targets_held(held: dict[str, Any]) -> str:
    """The largest measured concurrency that kept every target."""
    best, n = held["max_concurrency"], held["points"]
    points = f"{n} measured point{'s' if n != 1 else ''}"
    if best is None:
        return f"latency targets, measured: no point kept every target ({points})"
    return (
        f"latency targets, measured: the largest concurrency that kept every target is {best} "
        f"({points})"
    )


def _critical(dec: dict[str, float]) -> str:
    with_kv, no_kv = dec["critical_batch"], dec["critical_batch_no_kv"]
    kv = "never" if math.isinf(with_kv) else f"{with_kv:,.0f}"
    return f"{kv} with KV reads; {no_kv:,.0f} without"


def render_comparison(plan: Plan, measured: Measured, rows: list[ComparisonRow]) -> str:
    """Predicted lower bounds beside the measurement."""
    w = plan.workload
    header = (
        f"predicted vs measured: {measured.source} [{measured.label}] "
        f"(planned as prompt {w['prompt_tokens']} + output {w['output_tokens']}, "
        f"batch {w['batch']})"
    )
    lines = [header, f"  {'':<20}{'lower bound':>14}{'measured':>14}   bound/measured"]
    for row in rows:
        if row.unit == "s":
            predicted, got = fmt_time(row.predicted), fmt_time(row.measured)
        else:
            predicted = f"{row.predicted:,.1f} {row.unit}"
            got = "-" if row.measured is None else f"{row.measured:,.1f} {row.unit}"
        ratio = "-" if row.ratio is None else f"{row.ratio:.3f} ({row.ratio_name})"
        lines.append(f"  {row.quantity:<20}{predicted:>14}{got:>14}   {ratio}")
    stats = [
        f"{name}: {stat}"
        for name, stat in (("TTFT", measured.ttft_stat), ("TPOT", measured.tpot_stat))
        if stat
    ]
    if stats:
        lines.append("  (" + "; ".join(stats) + ")")
    return "\n".join(lines)
