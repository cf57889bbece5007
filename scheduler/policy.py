"""Batching policies: *when* waiting requests may join the running batch.

The scheduler's step is the same in every mode; a policy only gates admission:

- ``continuous``: admit every step, as far as budget, ``max_num_seqs`` and blocks allow.
- ``static``: admit only when the running batch is empty, then take up to ``max_num_seqs``
  at once and run them all to completion before the next batch.
- ``dynamic``: like static, but a batch is formed only once ``max_num_seqs`` requests wait
  or the oldest has waited ``batch_wait_ms``.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.config import SchedulerConfig
from scheduler.request import Request


class BatchPolicy:
    """Continuous (iteration-level) admission: the default."""

    # Whether a request may join the batch in a step whose token budget is spent (it then
    # starts computing next step). Static batches take their members all at once.
    admits_without_budget = False

    def may_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> bool:
        return True

    def admission_limit(self, max_num_seqs: int, num_running: int) -> int:
        return max(0, max_num_seqs - num_running)


class StaticPolicy(BatchPolicy):
    admits_without_budget = True

    def may_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> bool:
        return not running


class DynamicPolicy(StaticPolicy):
    def __init__(self, max_num_seqs: int, batch_wait_s: float) -> None:
        self.max_num_seqs = max_num_seqs
        self.batch_wait_s = batch_wait_s

    def may_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> bool:
        if running or not waiting:
            return False
        full = len(waiting) >= self.max_num_seqs
        return full or now - waiting[0].arrival_time >= self.batch_wait_s


def make_policy(config: SchedulerConfig) -> BatchPolicy:
    if config.batching == "static":
        return StaticPolicy()
    if config.batching == "dynamic":
        return DynamicPolicy(config.max_num_seqs, config.batch_wait_ms / 1000.0)
    return BatchPolicy()
