"""Hold a plan's lower bounds against a measurement.

Every row's ratio is an efficiency in (0, 1] when the bound holds:

- TPOT: decode memory time / measured TPOT, the **implied MBU** (model bandwidth
  utilisation: bytes a step must read over the bytes the measured time could have read);
- TTFT: prefill compute time / measured TTFT, the implied MFU (or memory time, i.e. MBU,
  when the prefill is memory-bound, as tiny prompts are); TTFT also holds queueing, so a
  loaded server's TTFT ratio says more about the queue than the device;
- output throughput: measured / predicted bound (b requests of P + O tokens back to back).

A ratio above 1 means the measurement beat the bound: the device figures are wrong (a
``cpu`` measurement taken while other work ran, a wrong ``--device``) or the run was not
the workload planned (other lengths, another batch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from planner.measured import Measured
from planner.plan import Plan


@dataclass(frozen=True, slots=True)
class ComparisonRow:
    """One quantity, predicted beside measured."""

    quantity: str  # "TTFT", "TPOT", "output throughput"
    unit: str  # "s" or "tok/s"
    predicted: float
    measured: float | None
    ratio: float | None
    ratio_name: str  # "implied MBU", "implied MFU", "of bound"


def compare(plan: Plan, measured: Measured) -> list[ComparisonRow]:
    """The TTFT, TPOT and throughput rows (measured values may be None: not measured)."""
    rows: list[ComparisonRow] = []

    prefill = plan.prefill
    compute_bound = prefill["bound"] == "compute"
    ttft_work = prefill["compute_time_s"] if compute_bound else prefill["memory_time_s"]
    rows.append(
        ComparisonRow(
            "TTFT",
            "s",
            prefill["time_s"],
            measured.ttft_s,
            ttft_work / measured.ttft_s if measured.ttft_s else None,
            "implied MFU" if compute_bound else "implied MBU",
        )
    )

    decode = plan.decode
    rows.append(
        ComparisonRow(
            "TPOT",
            "s",
            decode["time_per_token_s"],
            measured.tpot_s,
            decode["memory_time_s"] / measured.tpot_s if measured.tpot_s else None,
            "implied MBU",
        )
    )

    predicted_tps = plan.generation["output_tokens_per_s"]
    rows.append(
        ComparisonRow(
            "output throughput",
            "tok/s",
            predicted_tps,
            measured.output_tokens_per_s,
            measured.output_tokens_per_s / predicted_tps if measured.output_tokens_per_s else None,
            "of bound",
        )
    )
    return rows


def comparison_dict(plan: Plan, measured: Measured, rows: list[ComparisonRow]) -> dict[str, Any]:
    """The --json form of one comparison."""
    return {
        "measured": asdict(measured),
        "workload": plan.workload,
        "rows": [asdict(r) for r in rows],
    }
