"""Tables of a comparison result: rows with ratios against the baseline, text and markdown.

They read the comparison's JSON dict, so ``python -m loadtest report compare.json`` can
re-print a saved comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.report import fmt_ratio, format_markdown, format_table, ratio


def comparison_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (scenario, mode) with the ratios against the baseline."""
    rows: list[dict[str, Any]] = []
    modes = {m["name"]: m for m in result["modes"]}
    base = modes.get(result["baseline"])
    for scenario in result["scenarios"]:
        name = scenario["name"]
        base_run = base["runs"].get(name) if base else None
        b = base_run["points"][0]["summary"] if base_run else {}
        for mode in result["modes"]:
            run = mode["runs"].get(name)
            if not run:
                continue
            s = run["points"][0]["summary"]
            rows.append(
                {
                    "scenario": name,
                    "mode": mode["name"],
                    "request_rate": run["points"][0]["point"]["request_rate"],
                    "output_throughput_tok_s": s["output_throughput_tok_s"],
                    "ttft_p50_s": s["ttft_p50_s"],
                    "tpot_p50_s": s["tpot_p50_s"],
                    "goodput_req_s": s["goodput_req_s"],
                    "goodput_fraction": s["goodput_fraction"],
                    "num_errors": s["num_errors"],
                    "throughput_vs_baseline": ratio(
                        s["output_throughput_tok_s"], b.get("output_throughput_tok_s")
                    ),
                    "ttft_p50_lower_vs_baseline": ratio(
                        s["ttft_p50_s"], b.get("ttft_p50_s"), lower_is_better=True
                    ),
                    "goodput_vs_baseline": ratio(s["goodput_req_s"], b.get("goodput_req_s")),
                }
            )
    return rows


def _table(rows: Sequence[dict[str, Any]], baseline: str) -> tuple[list[str], list[list[str]]]:
    headers = [
        "scenario",
        "mode",
        "rate",
        "out_tok/s",
        f"x {baseline}",
        "ttft_p50_s",
        "x lower",
        "tpot_p50_ms",
        "goodput/s",
        f"x {baseline}",
        "good",
        "err",
    ]

    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    body = [
        [
            r["scenario"],
            r["mode"],
            "-" if r["request_rate"] is None else f"{r['request_rate']:.3g}",
            f(r["output_throughput_tok_s"], ".1f"),
            fmt_ratio(r["throughput_vs_baseline"]),
            f(r["ttft_p50_s"], ".3f"),
            fmt_ratio(r["ttft_p50_lower_vs_baseline"]),
            "-" if r["tpot_p50_s"] is None else f"{r['tpot_p50_s'] * 1000:.0f}",
            f(r["goodput_req_s"], ".3f"),
            fmt_ratio(r["goodput_vs_baseline"]),
            "-" if r["goodput_fraction"] is None else f"{r['goodput_fraction'] * 100:.0f}%",
            str(r["num_errors"]),
        ]
        for r in rows
    ]
    return headers, body


def compare_table(result: dict[str, Any]) -> str:
    headers, body = _table(result["table"], result["baseline"])
    return format_table(headers, body)


def compare_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    headers, body = _table(result["table"], result["baseline"])
    lines = [
        "# Batching-mode comparison",
        "",
        f"- created: {result['created_at']}",
        *([f"- command: `{cfg['invocation']}`"] if cfg.get("invocation") else []),
        f"- workload: prompt `{cfg['prompt_len']}`, output `{cfg['output_len']}`, seed "
        f"{cfg['seed']}, ignore_eos={cfg['ignore_eos']}",
        f"- max_num_seqs {cfg['max_num_seqs']}; closed loop at concurrency {cfg['concurrency']}"
        f" ({cfg['num_requests']} requests); baseline `{result['baseline']}` capacity "
        + ("-" if result["capacity_req_s"] is None else f"{result['capacity_req_s']:.3f} req/s"),
        f"- SLO for goodput: TTFT <= {cfg['slo']['ttft_s']} s, TPOT <= {cfg['slo']['tpot_s']} s",
        "",
        "| mode | command |",
        "|---|---|",
        *(f"| {m['name']} | `{' '.join(m['command'])}` |" for m in result["modes"]),
        "",
        format_markdown(headers, body),
        "",
    ]
    for mode in result["modes"]:
        if mode["error"]:
            lines.append(f"- **{mode['name']} failed**: {mode['error'].splitlines()[0]}")
    if result["plots"]:
        lines += ["", *(f"![{Path(p).name}]({Path(p).name})" for p in result["plots"])]
    else:
        lines += ["", "(no plots: matplotlib is not installed)"]
    return "\n".join(lines) + "\n"
