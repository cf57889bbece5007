"""Plain-text and markdown tables of sweep summaries (read from result JSON dicts).

Tables are built from the JSON form so a saved result file can be re-printed, and so the
CLI, ``compare`` and the README show exactly the figures the file holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    key: str
    fmt: Callable[[Any], str]


def _num(digits: int) -> Callable[[Any], str]:
    return lambda v: "-" if v is None else f"{v:.{digits}f}"


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def _int(v: Any) -> str:
    return "-" if v is None else str(int(v))


SWEEP_COLUMNS: tuple[Column, ...] = (
    Column("reqs", "num_requests", _int),
    Column("ok", "num_completed", _int),
    Column("err", "num_errors", _int),
    Column("dur_s", "duration_s", _num(1)),
    Column("req/s", "request_throughput_req_s", _num(2)),
    Column("out_tok/s", "output_throughput_tok_s", _num(1)),
    Column("ttft_p50_ms", "ttft_p50_s", _ms),
    Column("ttft_p99_ms", "ttft_p99_s", _ms),
    Column("tpot_p50_ms", "tpot_p50_s", _ms),
    Column("tpot_p99_ms", "tpot_p99_s", _ms),
    Column("itl_p99_ms", "itl_p99_s", _ms),
    Column("e2e_p50_s", "e2e_p50_s", _num(2)),
    Column("goodput/s", "goodput_req_s", _num(2)),
    Column("good", "goodput_fraction", _pct),
    Column("max_conc", "max_concurrency", _int),
)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Right-aligned fixed-width columns (first column left-aligned)."""
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def format_markdown(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def sweep_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows for every point of a sweep result JSON."""
    headers = ["point", *(c.header for c in SWEEP_COLUMNS)]
    rows = [
        [p["point"]["label"], *(c.fmt(p["summary"].get(c.key)) for c in SWEEP_COLUMNS)]
        for p in result["points"]
    ]
    return headers, rows


def sweep_table(result: dict[str, Any]) -> str:
    headers, rows = sweep_rows(result)
    cfg = result["config"]
    slo = cfg["slo"]
    limits = [
        f"{name}<={slo[key]:g}s"
        for name, key in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("e2e", "e2e_s"))
        if slo[key] is not None
    ]
    title = (
        f"model={result['server']['model']}  prompt={cfg['prompt_len']}  "
        f"output={cfg['output_len']}  seed={cfg['seed']}  "
        f"SLO: {' '.join(limits) or 'none'}"
    )
    return title + "\n" + format_table(headers, rows)


def ratio(value: float | None, base: float | None, lower_is_better: bool = False) -> float | None:
    """value/base (or base/value when lower is better); None when undefined."""
    if value is None or base is None:
        return None
    num, den = (base, value) if lower_is_better else (value, base)
    return num / den if den > 0 else None


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"
