"""SchedulerOutput: the plan of one step, handed from the scheduler to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The step computes positions ``[start, start + num_tokens)`` of the request::

        |<---- start (already in the KV cache) ---->|<-- num_tokens (this step) -->|

    ``request`` is passed for reading only (sampling params, token ids for penalties); the
    runner must not change it.
    """

    request: Request
    start: int
    num_tokens: int
    token_ids: list[int]  # the tokens at positions [start, start + num_tokens)
    block_ids: tuple[int, ...]  # the request's whole block table after allocation
    samples: bool  # the chunk reaches the request's last token: sample the next one

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def seq_len(self) -> int:
        """Tokens of context after this step (cached prefix + this chunk)."""
        return self.start + self.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """Who runs this step, in batch order, and what changed in the queues."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
