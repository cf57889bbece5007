"""Ratios, the speed targets and the printed table, from the result dict alone (no I/O).

Result layout (also the JSON written by ``--out``)::

    floors:        {"decode_s", "decode_served_s", "prefill_s"}  # from the run's first probe
    weight_bytes:  what a float32 decode step streams
    decode_weight_bytes: what the default server's batch-1 decode step reads (GGUF blocks)
    pagedserve:    {"startup_s", "points": {"<c>": row}}      # row: see servers.measure_server
    pagedserve_f32: same, concurrency 1 only: ``--matmul-weights float32``
    vllm:          same, when --vllm-cmd was given
    transformers:  {"ttft_s", "tpot_s", "tok_s_c1", "static_tok_s": {"<B>": tok/s}}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Target: pagedserve / vLLM output tok/s at these concurrencies.
TOK_S_VS_VLLM = {16: 1.2, 64: 1.1}
# Target: vLLM TPOT / pagedserve TPOT at these concurrencies.
TPOT_VS_VLLM = {1: 1.6}
# Target: pagedserve at concurrency B / one transformers static batch of B.
TOK_S_VS_STATIC = 1.5
# Concurrency at which the step overhead outside the forward is reported.
OVERHEAD_AT = 16
# Batch-1 decode: TPOT / (float32 weight bytes / bandwidth) at most this, and MBU (the bytes
# a server actually reads / bandwidth / its step time) at least the other.
TPOT_VS_FLOOR = 1.4
MBU_TARGET = 0.7
# The servers a result may hold, in the order the table prints them, with their row labels.
SERVER_LABELS = {
    "pagedserve": "pagedserve",
    "pagedserve_f32": "pagedserve float32 weights",
    "vllm": "vLLM (CPU)",
}


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the targets section: ``value`` against ``op target`` (None: unchecked)."""

    label: str
    value: float | None
    target: float | None = None
    op: str = ">="  # ">=" or "<="
    unit: str = "x"  # "x" (ratio), "%" (fraction shown as percent) or "" (a plain fraction)

    @property
    def passed(self) -> bool | None:
        if self.value is None or self.target is None:
            return None
        return self.value >= self.target if self.op == ">=" else self.value <= self.target


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is missing, zero or not finite."""
    if num is None or den is None or den == 0 or not math.isfinite(num / den):
        return None
    return num / den


def _point(result: dict[str, Any], server: str, c: int) -> dict[str, Any]:
    return (result.get(server) or {}).get("points", {}).get(str(c)) or {}


def decode_floor(result: dict[str, Any], row: dict[str, Any]) -> float:
    """The batch-1 decode floor a row is judged by: the float32 weight bytes over the
    bandwidth probed beside the row's point when it was (``bandwidth_bytes_s``), else over
    the run's first probe. The bandwidth a shared machine gives moves by tens of percent
    between minutes, so a floor read minutes away from the point would judge it by another
    machine's speed."""
    bandwidth, wbytes = row.get("bandwidth_bytes_s"), result.get("weight_bytes")
    if bandwidth and wbytes:
        return float(wbytes) / float(bandwidth)
    return float(result["floors"]["decode_s"])


def checks(result: dict[str, Any], concurrencies: list[int]) -> list[Check]:
    """Every ratio the speed targets name, with its target where it sets one."""
    out: list[Check] = []
    hf = result.get("transformers")
    has_vllm = "vllm" in result
    for c in concurrencies:
        ps, vl = _point(result, "pagedserve", c), _point(result, "vllm", c)
        if hf is not None:
            if c == 1:
                base, what, target = hf.get("tok_s_c1"), "transformers b=1", None
            else:
                base = hf.get("static_tok_s", {}).get(str(c))
                what, target = f"transformers static b={c}", TOK_S_VS_STATIC
            out.append(
                Check(
                    f"c={c} tok/s pagedserve / {what}", ratio(ps.get("output_tok_s"), base), target
                )
            )
        if has_vllm:
            out.append(
                Check(
                    f"c={c} tok/s pagedserve / vLLM",
                    ratio(ps.get("output_tok_s"), vl.get("output_tok_s")),
                    TOK_S_VS_VLLM.get(c),
                )
            )
            out.append(
                Check(
                    f"c={c} TPOT p50 vLLM / pagedserve",
                    ratio(vl.get("tpot_p50_s"), ps.get("tpot_p50_s")),
                    TPOT_VS_VLLM.get(c),
                )
            )
            for key, what in (("ttft_p50_s", "TTFT p50"), ("itl_p99_s", "ITL p99")):
                out.append(
                    Check(
                        f"c={c} {what} pagedserve / vLLM",
                        ratio(ps.get(key), vl.get(key)),
                        1.0,
                        op="<=",
                    )
                )
        if c > 1:
            out.append(Check(f"c={c} MFU pagedserve", ps.get("mfu"), unit="%"))
    if 1 in concurrencies:
        out.extend(_batch1_checks(result))
    if OVERHEAD_AT in concurrencies:
        ps = _point(result, "pagedserve", OVERHEAD_AT)
        out.append(
            Check(
                f"c={OVERHEAD_AT} step time outside the model forward",
                ps.get("overhead_fraction"),
                unit="%",
            )
        )
    return out


def _batch1_checks(result: dict[str, Any]) -> list[Check]:
    """The batch-1 decode target, both ways it can be read, for the default configuration
    and, when it was measured, ``pagedserve_f32``: TPOT against the float32 weights' floor
    (what a step must stream if it reads float32 weights), and MBU on the bytes each
    configuration actually reads, as the server's own gauge reports it. The default reads
    the checkpoint's GGUF blocks (fewer bytes, so a lower TPOT but a lower MBU);
    ``pagedserve_f32`` streams the float32 weights the floor counts."""
    out = []
    for server in ("pagedserve", "pagedserve_f32"):
        if server not in result:
            continue
        point, label = _point(result, server, 1), SERVER_LABELS[server]
        # The point was run STEADY_ATTEMPTS times and its bandwidth moved every time: its
        # floor is the higher probe's, which a point run partly in a slow period cannot meet.
        moved = " (bandwidth moved)" if point.get("bandwidth_steady") is False else ""
        out.append(
            Check(
                f"c=1 TPOT p50 {label} / decode floor{moved}",
                ratio(point.get("tpot_p50_s"), decode_floor(result, point)),
                TPOT_VS_FLOOR,
                op="<=",
            )
        )
        out.append(
            Check(f"c=1 MBU {label} (gauge, bytes read)", gauge_mbu(point), MBU_TARGET, unit="")
        )
    return out


def gauge_mbu(row: dict[str, Any]) -> float | None:
    """The server's own MBU gauge for a row (the median of its scrapes during the point),
    moved from the peak the server divides by (the bandwidth it read at start-up,
    ``server_peak_bandwidth_bytes_s``) to the bandwidth probed beside the point, when both
    are known: the bytes/s the gauge reports are the same, the yardstick is the one the
    row's floor uses."""
    mbu, peak, beside = (
        row.get("server_mbu"),
        row.get("server_peak_bandwidth_bytes_s"),
        row.get("bandwidth_bytes_s"),
    )
    if mbu is None or not peak or not beside:
        return mbu
    return float(mbu) * float(peak) / float(beside)


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def format_checks(items: list[Check]) -> str:
    lines = [f"{'speed targets':54}{'value':>9}{'target':>10}"]
    for item in items:
        pct = item.unit == "%"
        value = _fmt(item.value, ".1f" if pct else ".2f", 100 if pct else 1) + item.unit
        target = "" if item.target is None else f"{item.op} {item.target:g}{item.unit}"
        verdict = {True: "ok", False: "MISSED", None: ""}[item.passed]
        lines.append(f"{item.label:54}{value:>9}{target:>10}  {verdict}".rstrip())
    return "\n".join(lines)


def format_table(result: dict[str, Any], concurrencies: list[int]) -> str:
    """Servers and baselines side by side, one block of rows per concurrency.

    ``xfloor`` is TTFT / prefill floor and TPOT / decode floor (the float32 weights'
    floor, for every row, over the bandwidth probed beside the row's point when it was:
    ``decode_floor``); ``MBU`` is the weight bytes the row's server reads per decode
    step / bandwidth / TPOT: what the server's ``pagedserve_decode_step_weight_bytes`` says
    it reads, else for the default pagedserve row the run's count of the same bytes
    (``decode_weight_bytes``: GGUF blocks), else the float32 weights; ``srvMBU`` is the
    server's own gauge, the median of the scrapes during the point, at the bandwidth probed
    beside the point when it was (``gauge_mbu``); ``MFU`` is model FLOP/s over the best
    matmul ceiling the run measured at any row count (``benchmarks.speed``).
    """
    floors = result["floors"]

    def read_share(server: str | None, r: dict[str, Any]) -> float:
        # the row's decode-step bytes as a share of the float32 weights the floor streams
        own, f32 = r.get("decode_weight_bytes"), result.get("weight_bytes")
        if not own and server == "pagedserve":
            own = result.get("decode_weight_bytes")
        return own / f32 if own and f32 else 1.0

    header = (
        f"{'':28}{'conc':>5}{'TTFT ms':>9}{'xfloor':>7}{'TPOT ms':>9}{'xfloor':>7}"
        f"{'ITLp99 ms':>10}{'tok/s':>8}{'MBU':>6}{'srvMBU':>7}{'MFU':>8}"
    )
    lines = [header]

    def row(name: str, c: int, r: dict[str, Any], server: str | None = None) -> str:
        ttft, tpot = r.get("ttft_p50_s"), r.get("tpot_p50_s")
        return (
            f"{name:28}{c:>5}{_fmt(ttft, '.0f', 1e3):>9}"
            f"{_fmt(ratio(ttft, floors['prefill_s']), '.2f'):>7}"
            f"{_fmt(tpot, '.1f', 1e3):>9}{_fmt(ratio(tpot, decode_floor(result, r)), '.2f'):>7}"
            f"{_fmt(r.get('itl_p99_s'), '.1f', 1e3):>10}{_fmt(r.get('output_tok_s'), '.1f'):>8}"
            f"{_fmt(ratio(decode_floor(result, r) * read_share(server, r), tpot), '.2f'):>6}"
            f"{_fmt(gauge_mbu(r), '.2f'):>7}{_fmt(r.get('mfu'), '.1%'):>8}"
        )

    hf = result.get("transformers")
    for c in concurrencies:
        for server, label in SERVER_LABELS.items():
            if point := _point(result, server, c):
                lines.append(row(label, c, point, server))
        if hf is None:
            continue
        if c == 1:
            hf_row = {"ttft_p50_s": hf["ttft_s"], "tpot_p50_s": hf["tpot_s"]}
            lines.append(
                row("transformers.generate() b=1", c, hf_row | {"output_tok_s": hf["tok_s_c1"]})
            )
        elif str(c) in hf.get("static_tok_s", {}):
            lines.append(
                row(f"transformers static b={c}", c, {"output_tok_s": hf["static_tok_s"][str(c)]})
            )
    return "\n".join(lines)
