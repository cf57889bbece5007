"""Batching policies: *when* waiting requests may join the running batch.

The scheduler's step is the same in every mode; a policy only gates admission:

- ``continuous``: admit every step, as far as budget, ``max_num_seqs`` and blocks allow;
  finished requests leave at once.
- ``static``: admit only when no member of the previous batch is running, then take up to
  ``max_num_seqs`` at once and run them all to completion before the next batch.
- ``dynamic``: like static, but a batch is formed only once ``max_num_seqs`` requests wait
  or the oldest has waited ``batch_wait_ms``.

What happens to a member of a static/dynamic batch that finishes early (padding, or not) is
the scheduler's business (``SchedulerConfig.static_finished``); the policy only says whether
the mode runs batches to completion (``runs_to_completion``).

Times are on the scheduler's clock (``time.monotonic`` unless a test injects another), the
clock ``Request.arrival_time`` must also be on.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.config import SchedulerConfig
from scheduler.request import Request


class BatchPolicy:
    """Continuous (iteration-level) admission: the default."""

    # Whether a batch, once formed, runs until its last member finishes before anyone else
    # is admitted (static and dynamic). Finished members may then stay as padding.
    runs_to_completion = False
    # Whether a request may join the batch in a step whose token budget is spent (it then
    # starts computing next step). Static batches take their members all at once.
    admits_without_budget = False

    def may_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> bool:
        """Args:
            running: the running requests (the current batch, in admission order).
            waiting: the queue, head first.
            now: the scheduler's clock.
        Returns:
            Whether waiting requests may be admitted in this step.
        """
        return True

    def admission_limit(self, max_num_seqs: int, num_running: int) -> int:
        """Returns:
        How many requests this step may admit at most.
        """
        return max(0, max_num_seqs - num_running)

    def admission_time(self, waiting: Sequence[Request]) -> float | None:
        """When a timed window would open admission for ``waiting``, for a policy that holds
        requests back on a timer; None for policies without one.

        Args:
            waiting: the queue, head first (non-empty).
        Returns:
            A time on the scheduler's clock, or None.
        """
        return None


class StaticPolicy(BatchPolicy):
    runs_to_completion = True
    admits_without_budget = True

    def may_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> bool:
        return not running


class DynamicPolicy(StaticPolicy):
    def __init__(self, max_num_seqs: int, batch_wait_s: float) -> None:
        """Args:
        max_num_seqs: a queue this long forms a batch at once.
        batch_wait_s: otherwise, the oldest waiting request's wait that forms one.
        """
        self.max_num_seqs = max_num_seqs
        self.batch_wait_s = batch_wait_s

    def may_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> bool:
        if running or not waiting:
            return False
        if len(waiting) >= self.max_num_seqs:
            return True
        window_end = self.admission_time(waiting)
        assert window_end is not None
        return now >= window_end

    def admission_time(self, waiting: Sequence[Request]) -> float | None:
        # The queue head is the oldest request: FCFS order is arrival order, and requests
        # preempted back to the front arrived earlier still.
        return waiting[0].arrival_time + self.batch_wait_s


def make_policy(config: SchedulerConfig) -> BatchPolicy:
    """Returns:
    The policy object for ``config.batching``.
    """
    if config.batching == "static":
        return StaticPolicy()
    if config.batching == "dynamic":
        return DynamicPolicy(config.max_num_seqs, config.batch_wait_ms / 1000.0)
    return BatchPolicy()
