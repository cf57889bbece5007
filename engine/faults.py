"""Fault isolation inside one engine step.

A step computes every scheduled request in one forward pass, so an exception from
``ModelRunner.execute`` does not say *which* request caused it. ``execute_isolating`` finds out
by bisection: it re-runs the step's live rows in halves, and a row that still raises when it
runs alone is the one that fails; every other row gets its token as if nothing happened::

    failed step     | a b c P d e |                  P raises whenever it is computed
    halves          | a b c |  | P d e |  -> ok, raises
    quarters                   | P |  | d e |        -> raises (alone: P fails), ok

Why re-running is sound. The failed attempt changed no scheduler state (``num_computed_tokens``
advances only in ``update_from_output``) and no prefix-cache hash (committed there too); the
K/V rows it may have written belong to positions the re-run writes again. Rows of different
requests never read each other's new K/V within a step (the scheduler defers a request to a
block that another one is filling), so computing the rows in several smaller batches gives
each request the same token up to float rounding. Static-batch padding rows are left out:
they are nobody's output. Copy-on-write copies (``blocks_to_copy``) must happen once, before
the first write into their destination: every sub-run carries them until one succeeds.

What it costs and what it cannot do. A poisoned row costs about 2·log2(rows) extra forward
passes in the step where it fails. A failure that is not about one row (a broken device, an
allocation that the whole batch is too big for) either goes away in the smaller batches (then
nobody fails) or reaches every row alone (then every row fails): the outcome is honest either
way. A seeded request's plain samples are those of its run alone (the sampler's noise is a
function of the seed and the output position only), but a speculative row's verification may
draw differently, because the failed attempt may already have advanced the speculator's
generator for it.

Tests engineer per-request failures with tests/engine/fault_runner.py, which wraps a built
engine's runner; nothing in the serving path injects faults.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from engine.outputs import ModelRunnerOutput
from scheduler.output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class EngineFatalError(RuntimeError):
    """A failure that is nobody's request: the engine cannot run another step (a
    tensor-parallel rank is gone, engine/tp_group.py). Never isolated nor retried; it
    propagates out of ``LLMEngine.step()`` and stops the engine loop."""


class Runner(Protocol):
    """What fault isolation needs of a runner: ``ModelRunner``, or a test's wrapper of it."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def execute_isolating(
    runner: Runner, out: SchedulerOutput, error: BaseException
) -> tuple[ModelRunnerOutput, dict[str, str]]:
    """Re-run a step whose ``runner.execute(out)`` raised, in halves, to find the failing rows.

    Args:
        runner: the runner that raised.
        out: the step's ``SchedulerOutput``, as ``schedule()`` returned it.
        error: what ``runner.execute(out)`` raised (the error of a step of one row).
    Returns:
        The merged output of every sub-run that succeeded, and request id -> error message
        for the requests whose row raised when computed alone.
    """
    rows = [item for item in out.scheduled if not item.padding]
    merged = ModelRunnerOutput([], [], [])
    failed: dict[str, str] = {}
    copies = list(out.blocks_to_copy)

    def run(group: Sequence[ScheduledRequest], known_error: BaseException | None) -> None:
        nonlocal copies
        error = known_error
        if error is None:
            try:
                sub_out = SchedulerOutput(scheduled=list(group), blocks_to_copy=copies)
                result = runner.execute(sub_out)
            except Exception as exc:  # noqa: BLE001 - any failure of the rows is the request's
                error = exc
            else:
                copies = []  # done once: later sub-runs must not overwrite what this one wrote
                merged.request_ids.extend(result.request_ids)
                merged.token_ids.extend(result.token_ids)
                merged.logprobs.extend(result.logprobs)
                merged.prompt_logprobs.update(result.prompt_logprobs)
                return
        if len(group) == 1:
            failed[group[0].request_id] = describe(error)
            return
        middle = len(group) // 2
        run(group[:middle], None)
        run(group[middle:], None)

    if rows:
        # Without padding, these rows are exactly what failed: split them (or, if there is
        # one, it is the culprit) without running them again. With padding, the padding may
        # have been the cause, so the live rows are tried once more on their own first.
        run(rows, error if len(rows) == len(out.scheduled) else None)
    return merged, failed
