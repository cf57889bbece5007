"""Latency targets: how many prompt tokens a step may compute so that running decodes keep
their inter-token latency (ITL) and time-per-output-token (TPOT) targets, and queued prompts
their time-to-first-token (TTFT) target.

A step is one iteration of the engine loop; every running decode waits for it, so a step's
time *is* each decoding request's inter-token latency. Decodes cost what they cost (one token
each, never capped); what a step can choose is how many prompt tokens it adds::

    step time ~ gap before the step + t(decode rows, their context, prefill tokens p)
                                       \\_____ fixed by the running batch ____/  \\_ chosen _/

The scheduler does not time anything itself. The engine owns a ``StepTimePredictor``
(engine/step_predictor.py: the cost model, calibrated online by measured step times) and
reports each step's measured time back (``Scheduler.observe_step``). This module turns the
targets and that prediction into the step's prompt-token cap:

1. **Budget.** The step's time budget is the smallest of: the ITL target; the relative ITL
   target, ``target_itl_ratio`` times the iteration the same decodes would take alone
   (predicted step plus the gap); the TPOT target plus the credit earlier steps left under
   it (capped at ``TPOT_CREDIT_STEPS`` targets). The engine loop's recent gap between steps
   (a moving average) is taken off it.
2. **Cap.** The predictor says how many prompt tokens fit in that budget beside this step's
   decodes. The cap is never below ``min_prefill_chunk_tokens``: a step whose decodes alone
   exceed the budget still moves prefill forward, so no prompt starves.
3. **TTFT.** With a TTFT target, the queue (prompts not yet at their first token, FCFS) is
   replayed at that cap: if some prompt would get its first token after its deadline, the
   budget grows to the ITL bound, absolute or relative (without either, to the step's whole
   token budget). If even that misses, the step reports a *conflict* (a counter, and a log
   line at most every ``CONFLICT_LOG_INTERVAL_S``): both targets cannot be kept at this
   load.

A step without decodes has nobody's ITL to protect: it takes the ordinary budget.

Ownership: ``LatencyTargets`` owns the TPOT credit, the gap average and the conflict log's
clock. It reads the scheduler's queues and changes none of them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from scheduler.config import SchedulerConfig
from scheduler.request import Request

logger = logging.getLogger(__name__)

# A TPOT target is an average: a step may use the time at most this many earlier steps left
# under the target, so one long step cannot spend a whole quiet minute's credit.
TPOT_CREDIT_STEPS = 3.0
# Weight of the newest gap in the moving average of the engine loop's gap between steps.
GAP_SMOOTHING = 0.2
CONFLICT_LOG_INTERVAL_S = 10.0
# The TTFT check replays at most this many queued prompts (the queue head matters first).
TTFT_LOOKAHEAD = 256


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """What a step's decodes (one-token rows) cost it before any prompt token is added.

    Args:
        num_rows: one-token rows (decodes and static-batch padding).
        num_context_tokens: those rows' context after the step (their ``seq_len`` summed):
            the KV the decodes read.
        prefill_start: tokens already cached ahead of the first prompt chunk (its attention
            reads them); 0 for a new prompt.
    """

    num_rows: int
    num_context_tokens: int
    prefill_start: int = 0


class StepTimePredictor(Protocol):
    """The engine's model of a step's wall time (engine/step_predictor.py)."""

    def predict(self, load: DecodeLoad, num_prefill_tokens: int) -> float | None:
        """Seconds a step with ``load``'s decodes and ``num_prefill_tokens`` prompt tokens
        takes; None before the predictor has seen a step."""
        ...

    def prefill_tokens_within(self, load: DecodeLoad, budget_s: float, max_tokens: int) -> int:
        """The most prompt tokens (0..``max_tokens``) a step with ``load``'s decodes may add
        and be predicted to take at most ``budget_s``; 0 before it has seen a step."""
        ...


@dataclass(frozen=True, slots=True)
class TargetDecision:
    """What the targets made of one step (``SchedulerOutput.target``, for stats).

    Args:
        budget_s: the whole iteration's time budget (gap included) the cap was sized for.
        prefill_cap: prompt tokens the step could compute.
        ttft_boost: the TTFT target grew the budget beyond the ITL/TPOT one.
        conflict: the TTFT target would be missed even at the largest budget allowed.
        sized: the step was planned with decodes, so the targets chose ``prefill_cap``;
            False for a step without decodes, or before a relative target has a step to
            be relative to: its cap is the whole prompt budget.
    """

    budget_s: float
    prefill_cap: int
    ttft_boost: bool = False
    conflict: bool = False
    sized: bool = True


class LatencyTargets:
    """The targets of one scheduler, and the state they carry from step to step."""

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor) -> None:
        """Args:
        config: its ``target_*_ms`` and ``min_prefill_chunk_tokens`` are read.
        predictor: the engine's step-time model.
        """
        self.predictor = predictor
        self.itl_s = _seconds(config.target_itl_ms)
        self.itl_ratio = config.target_itl_ratio
        self.tpot_s = _seconds(config.target_tpot_ms)
        self.ttft_s = _seconds(config.target_ttft_ms)
        self.min_chunk = config.min_prefill_chunk_tokens
        self.tpot_credit_s = 0.0
        self.gap_s = 0.0
        self.num_conflicts = 0
        self._conflict_logged_at = -math.inf

    # ---- what the engine reports ----------------------------------------------------------

    def observe(self, step_s: float, gap_s: float | None, had_decodes: bool) -> None:
        """A step ran.

        Args:
            step_s: its wall time (``LLMEngine.step``).
            gap_s: the engine loop's time between the previous step's end and this one's
                start, when it had work all along; None after an idle spell.
            had_decodes: whether any request decoded in it (only those steps spend or
                earn TPOT credit: a prefill-only step delays nobody's next token).
        """
        if gap_s is not None:
            self.gap_s += GAP_SMOOTHING * (gap_s - self.gap_s)
        if self.tpot_s is not None and had_decodes:
            iteration_s = step_s + (gap_s or 0.0)
            limit = TPOT_CREDIT_STEPS * self.tpot_s
            self.tpot_credit_s = min(
                limit, max(-self.tpot_s, self.tpot_credit_s + self.tpot_s - iteration_s)
            )

    # ---- the step's cap -------------------------------------------------------------------

    def decide(
        self,
        load: DecodeLoad,
        max_prompt: int,
        prefilling: Sequence[Request],
        waiting: Iterable[Request],
        now: float,
    ) -> TargetDecision:
        """The prompt-token cap of the step being planned.

        Args:
            load: the step's decodes.
            max_prompt: the prompt tokens the step could take without targets
                (``StepBudget.prompt``); the cap never exceeds it.
            prefilling: running requests whose prompt is still being prefilled, in order.
            waiting: the queue, head first.
            now: the scheduler's clock (requests' ``arrival_time`` is on it).
        Returns:
            The budget and the cap (``min_prefill_chunk_tokens <= cap <= max_prompt``, or
            ``max_prompt`` when it is smaller, the step has no decodes or no bound is
            known yet).
        """
        itl_bounds = self._itl_bounds_s(load)
        budget_s = self._base_budget_s(itl_bounds)
        if load.num_rows == 0 or math.isinf(budget_s):
            # Nobody decodes: no inter-token latency to keep (or, with only a relative
            # target, no step measured yet to be relative to). The whole budget goes to
            # prompts.
            return TargetDecision(budget_s, max_prompt, sized=False)
        cap = self._cap(load, budget_s, max_prompt)
        if self.ttft_s is None or cap >= max_prompt:
            return TargetDecision(budget_s, cap)
        queue = _first_token_queue(prefilling, waiting)
        if not queue or not self._misses_ttft(queue, load, cap, now):
            return TargetDecision(budget_s, cap)
        # Queued prompts would miss TTFT at this share: grow it to the largest budget allowed.
        wide_s = min(itl_bounds, default=math.inf)
        wide_cap = max_prompt if math.isinf(wide_s) else self._cap(load, wide_s, max_prompt)
        conflict = self._misses_ttft(queue, load, wide_cap, now)
        if conflict:
            self._report_conflict(wide_s, now)
        boost = wide_cap > cap
        return TargetDecision(wide_s if boost else budget_s, max(cap, wide_cap), boost, conflict)

    def _itl_bounds_s(self, load: DecodeLoad) -> list[float]:
        """The bounds on the iteration of a step with ``load``'s decodes that hold step by
        step: the ITL target, and ``target_itl_ratio`` times their iteration alone (none
        before the predictor has seen a step)."""
        bounds = [self.itl_s] if self.itl_s is not None else []
        if self.itl_ratio is not None:
            alone_s = self.predictor.predict(load, 0)
            if alone_s is not None:
                bounds.append(self.itl_ratio * (alone_s + self.gap_s))
        return bounds

    def _base_budget_s(self, itl_bounds: list[float]) -> float:
        budgets = list(itl_bounds)
        if self.tpot_s is not None:
            budgets.append(self.tpot_s + self.tpot_credit_s)
        return min(budgets, default=math.inf)

    def _cap(self, load: DecodeLoad, budget_s: float, max_prompt: int) -> int:
        """Prompt tokens that fit in ``budget_s`` (the gap taken off), floored at the
        minimum chunk, within ``max_prompt``."""
        fit = self.predictor.prefill_tokens_within(load, budget_s - self.gap_s, max_prompt)
        return min(max_prompt, max(fit, self.min_chunk))

    def _misses_ttft(
        self, queue: list[tuple[float, int]], load: DecodeLoad, cap: int, now: float
    ) -> bool:
        """Whether some queued prompt, prefilled FCFS at ``cap`` tokens a step, would get
        its first token after ``arrival + target``.

        Args:
            queue: (arrival time, prompt tokens still to compute), in service order.
        """
        assert self.ttft_s is not None
        step_s = self.predictor.predict(load, cap)
        if step_s is None or cap <= 0:
            return False
        step_s += self.gap_s
        ahead = 0
        for arrival, remaining in queue:
            ahead += remaining
            finish = now + math.ceil(ahead / cap) * step_s
            if finish > arrival + self.ttft_s:
                return True
        return False

    def _report_conflict(self, budget_s: float, now: float) -> None:
        self.num_conflicts += 1
        if now - self._conflict_logged_at < CONFLICT_LOG_INTERVAL_S:
            return
        self._conflict_logged_at = now
        assert self.ttft_s is not None
        within = "the ITL target" if math.isfinite(budget_s) else "the whole step budget"
        logger.warning(
            "latency targets conflict: queued prompts miss the %.0f ms TTFT target even with "
            "%s for prefill (%d such steps so far); the load is above what both targets "
            "allow",
            self.ttft_s * 1000,
            within,
            self.num_conflicts,
        )


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def _first_token_queue(
    prefilling: Sequence[Request], waiting: Iterable[Request]
) -> list[tuple[float, int]]:
    """(arrival, tokens to compute before the first token) of the prompts still waiting for
    their first token, in the order FCFS prefills them. Preempted requests already had
    theirs: they take prefill time (counted as ahead) but have no TTFT deadline left."""
    queue: list[tuple[float, int]] = []
    carried = 0
    for request in [*prefilling, *_head(waiting)]:
        remaining = request.num_tokens - request.num_computed_tokens
        if request.output_token_ids:
            carried += remaining
            continue
        queue.append((request.arrival_time, remaining + carried))
        carried = 0
    return queue


def _head(waiting: Iterable[Request]) -> list[Request]:
    head: list[Request] = []
    for request in waiting:
        if len(head) == TTFT_LOOKAHEAD:
            break
        head.append(request)
    return head
