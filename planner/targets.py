"""Latency targets in the plan: the largest concurrency at which ``--target-itl-ms``,
``--target-itl-ratio``, ``--target-tpot-ms`` and ``--target-ttft-ms`` can hold, from the
arithmetic.

The server keeps an ITL/TPOT target by sizing each step's prefill (scheduler/
latency_targets.py). In a steady state at concurrency ``b``, with prompts of P tokens and O
outputs, ``b / O`` requests finish per step, so every step must also prefill ``b * P / O``
prompt tokens to keep ``b`` requests running. A step is then::

    t_step(b) = max( (W_s + b * c * k + s * k) / BW,                 weights, KV read and written
                     (2 * P_s * (b + s) + A(c) * b + A_s) / F )      matmuls and attention
    with s = b * P / O prefill tokens a step, c the mean context, A_s their attention

and each decoding request gets one token per step, so ITL = TPOT = t_step(b). The ratio
target bounds a step with prompt tokens by a multiple R of the same decodes alone, as the
server sizes its steps: the steady state holds it where t(b, s) <= R * t(b, 0), that is where
the prompts that keep ``b`` requests running fit beside them. A new prompt gets the prefill
share the step budget (the ITL/TPOT targets, and R * t(b, 0)) leaves beside the ``b`` decodes
(the server fills it while prompts wait; at least ``s``, at most the prompt), ``s_ttft``, so
TTFT ~ ceil(P / s_ttft) * t(b, s_ttft), queueing aside. The largest ``b`` that keeps every
target set (and whose KV fits the memory) is the answer; every figure grows with ``b`` (the
ratio too: the prompt tokens a step needs grow as ``b``, a step's bytes more slowly), so it is
found by bisection.

These are roofline lower bounds, like the rest of the plan: a real step takes longer
(``--measured`` shows by how much), so the measured concurrency at which a target holds is
lower.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Bisection's ceiling: no plan here needs a concurrency beyond this.
MAX_CONCURRENCY = 1 << 16


@dataclass(frozen=True, slots=True)
class Targets:
    """Latency targets in seconds; None where not set."""

    itl_s: float | None = None
    tpot_s: float | None = None
    ttft_s: float | None = None
    # A step with prompt tokens over the same decodes alone (the server's
    # --target-itl-ratio); measured as the ITL p99 over its p50.
    itl_ratio: float | None = None

    def __post_init__(self) -> None:
        for name in ("itl_s", "tpot_s", "ttft_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"latency targets must be positive milliseconds, got {value}")
        ratio = self.itl_ratio
        if ratio is not None and not (ratio > 1 and math.isfinite(ratio)):
            raise ValueError(f"an ITL ratio target must be a number above 1, got {ratio}")

    @property
    def any(self) -> bool:
        return any(
            value is not None for value in (self.itl_s, self.tpot_s, self.ttft_s, self.itl_ratio)
        )

    @classmethod
    def from_ms(
        cls,
        itl_ms: float | None,
        tpot_ms: float | None,
        ttft_ms: float | None,
        itl_ratio: float | None = None,
    ) -> Targets:
        """From ``--target-*-ms`` values and ``--target-itl-ratio``.

        Raises:
            ValueError: naming the flag whose value is out of range.
        """
        if itl_ratio is not None and not (itl_ratio > 1 and math.isfinite(itl_ratio)):
            raise ValueError(
                f"--target-itl-ratio must be a number above 1 (a step's time over its "
                f"decodes' own), got {itl_ratio:g}"
            )

        def s(flag: str, ms: float | None) -> float | None:
            if ms is None:
                return None
            if not (ms > 0 and math.isfinite(ms)):
                raise ValueError(f"--target-{flag}-ms must be a positive number, got {ms:g}")
            return ms / 1000.0

        return cls(s("itl", itl_ms), s("tpot", tpot_ms), s("ttft", ttft_ms), itl_ratio)


def steady_state(
    step_time_s: Callable[[int, float], float],
    b: int,
    prompt_tokens: int,
    output_tokens: int,
    budget_s: float | None = None,
    itl_ratio: float | None = None,
) -> dict[str, float]:
    """ITL/TPOT and TTFT at concurrency ``b`` in the steady state above.

    Args:
        step_time_s: t(b, s): a step of ``b`` decodes and ``s`` prefill tokens.
        budget_s: the step budget of the ITL/TPOT targets (None: no such target; a new
            prompt is then prefilled in one step).
        itl_ratio: the ratio target, which bounds the step budget by ``itl_ratio`` times
            the decodes' own step t(b, 0) as well.
    """
    prefill = b * prompt_tokens / output_tokens
    step = step_time_s(b, prefill)
    decode_step = step_time_s(b, 0.0)
    if itl_ratio is not None:
        ratio_budget = itl_ratio * decode_step
        budget_s = ratio_budget if budget_s is None else min(budget_s, ratio_budget)
    share = max(prefill, prompt_tokens) if budget_s is None else prefill
    if budget_s is not None and prefill < prompt_tokens:
        low, high = math.ceil(prefill), prompt_tokens  # the largest share within the budget
        if step_time_s(b, high) <= budget_s:
            low = high
        while high - low > 1:
            middle = (low + high) // 2
            if step_time_s(b, middle) <= budget_s:
                low = middle
            else:
                high = middle
        share = max(prefill, low) if step_time_s(b, low) <= budget_s else prefill
    return {
        "concurrency": b,
        "prefill_tokens_per_step": prefill,
        "step_time_s": step,
        "decode_step_s": decode_step,  # the same b decodes alone: the ratio target's unit
        "ttft_s": math.ceil(prompt_tokens / share) * step_time_s(b, share),
        "output_tokens_per_s": b / step,
    }


def holds(point: dict[str, float], targets: Targets) -> bool:
    step = point["step_time_s"]
    return (
        (targets.itl_s is None or step <= targets.itl_s)
        and (targets.itl_ratio is None or step <= targets.itl_ratio * point["decode_step_s"])
        and (targets.tpot_s is None or step <= targets.tpot_s)
        and (targets.ttft_s is None or point["ttft_s"] <= targets.ttft_s)
    )


def plan_targets(
    step_time_s: Callable[[int, float], float],
    targets: Targets,
    prompt_tokens: int,
    output_tokens: int,
    requests_fit: int,
) -> dict[str, Any]:
    """The largest concurrency at which ``targets`` hold, and the figures there.

    Args:
        step_time_s: t(b, s), as in ``steady_state``.
        targets: the targets set.
        prompt_tokens / output_tokens: P and O.
        requests_fit: requests whose KV fits the memory at once (the concurrency's cap).
    Returns:
        ``{"targets": {...}, "max_concurrency": b or 0, "limited_by": "targets" | "memory"
        | "none", "at_max": steady_state(b) or None}``.
    """
    limit = min(requests_fit, MAX_CONCURRENCY) if requests_fit > 0 else MAX_CONCURRENCY

    budgets = [t for t in (targets.itl_s, targets.tpot_s) if t is not None]
    budget_s = min(budgets) if budgets else None

    def point(b: int) -> dict[str, float]:
        return steady_state(
            step_time_s, b, prompt_tokens, output_tokens, budget_s, targets.itl_ratio
        )

    def ok(b: int) -> bool:
        return holds(point(b), targets)

    result: dict[str, Any] = {
        "targets": {
            "itl_s": targets.itl_s,
            "tpot_s": targets.tpot_s,
            "ttft_s": targets.ttft_s,
            "itl_ratio": targets.itl_ratio,
        },
        "max_concurrency": 0,
        "limited_by": "targets",
        "at_max": None,
    }
    if not ok(1):
        return result
    if ok(limit):
        best = limit
        result["limited_by"] = "memory" if requests_fit > 0 else "none"
    else:
        low, high = 1, limit  # ok(low), not ok(high)
        while high - low > 1:
            middle = (low + high) // 2
            if ok(middle):
                low = middle
            else:
                high = middle
        best = low
    result["max_concurrency"] = best
    result["at_max"] = point(best)
    return result


def measured_against(
    targets: Targets,
    tpot_s: float | None,
    ttft_s: float | None,
    concurrency: int | None,
    itl_p99_s: float | None = None,
    itl_p50_s: float | None = None,
) -> dict[str, Any]:
    """Whether a measurement kept the targets.

    The ITL target bounds every gap between two tokens, so it is checked against the
    measured ITL p99; only a measurement without one falls back to the TPOT (a median or
    mean, which averages a stalled step away), and ``itl_from`` says which was used. TPOT
    and TTFT targets are checked against the measurement's TPOT and TTFT statistics. The
    ratio target is checked against the ITL p99 over the ITL p50 (a decode step's gap):
    no figure without both.
    """
    itl_from = "itl_p99" if itl_p99_s is not None else "tpot"
    checks: dict[str, bool | None] = {}
    for name, target, got in (
        ("itl", targets.itl_s, itl_p99_s if itl_p99_s is not None else tpot_s),
        ("tpot", targets.tpot_s, tpot_s),
        ("ttft", targets.ttft_s, ttft_s),
    ):
        if target is not None:
            checks[name] = None if got is None else got <= target
    ratio = itl_p99_s / itl_p50_s if itl_p99_s is not None and itl_p50_s else None
    if targets.itl_ratio is not None:
        checks["itl_ratio"] = None if ratio is None else ratio <= targets.itl_ratio
    return {
        "concurrency": concurrency,
        "tpot_s": tpot_s,
        "ttft_s": ttft_s,
        "itl_p99_s": itl_p99_s,
        "itl_p50_s": itl_p50_s,
        "itl_ratio": ratio,
        "itl_from": itl_from,
        "held": checks,
    }


def largest_concurrency_held(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest measured concurrency at which every target held.

    Args:
        checks: ``measured_against`` results, one per measured point.
    Returns:
        ``{"max_concurrency": c or None, "points": n}``: a point counts only when it has a
        concurrency and a figure for every target set, each within its target.
    """
    held = [
        check["concurrency"]
        for check in checks
        if check["concurrency"] is not None and all(v is True for v in check["held"].values())
    ]
    return {"max_concurrency": max(held) if held else None, "points": len(checks)}
