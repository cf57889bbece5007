"""Padding: the finished members of a static/dynamic batch that are still computed.

A fixed batch (``transformers.generate()``, FasterTransformer-era servers) keeps computing
the rows of sequences that finished early until its last sequence finishes: that is what a
fixed batch costs. With ``static_finished="compute"`` the scheduler reproduces that cost:

  - a finishing member leaves ``running`` and its output is delivered at once (finish
    reason, last token), as in every mode. That favours static/dynamic a little over a real
    fixed-batch server, which returns results only when the whole batch ends: the cost of
    the padding is modelled, the delayed delivery is not;
  - it keeps its blocks and joins the padding; every step schedules it one dummy token
    (``ScheduledRequest.padding``): its last computed token re-fed at its last position, so
    the runner computes a real forward row attending over its whole cached context, writes
    no K/V (slot -1) and discards the row's logits;
  - when no member of the batch is running any more the batch has ended, and the
    scheduler frees the padding's blocks (``release_all``).

Ownership: the scheduler owns this object; blocks are freed only through the scheduler's
``KVCacheManager``.
"""

from __future__ import annotations

from kvpool.manager import KVCacheManager
from scheduler.output import ScheduledRequest
from scheduler.request import Request


class BatchPadding:
    """Finished batch members that keep their blocks and get a dummy row every step."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        """Keep a just-finished member (status already finished, blocks still owned)."""
        self.requests.append(request)

    def rows(self, kv: KVCacheManager, budget: int) -> list[ScheduledRequest]:
        """One dummy row per member, oldest first, while the token budget lasts.

        Args:
            kv: the block tables (read only).
            budget: tokens left in this step.
        Returns:
            At most ``budget`` padding rows, each one token at the member's last computed
            position (``seq_len`` = its whole cached context).
        """
        rows = []
        for request in self.requests[:budget]:
            position = request.num_computed_tokens - 1
            rows.append(
                ScheduledRequest(
                    request=request,
                    start=position,
                    num_tokens=1,
                    token_ids=[request.token_id_at(position)],
                    block_ids=kv.block_ids(request.request_id),
                    samples=False,
                    padding=True,
                )
            )
        return rows

    def release_newest(self, kv: KVCacheManager) -> None:
        """Stop computing the most recently finished member and free its blocks."""
        kv.free(self.requests.pop().request_id)

    def release_all(self, kv: KVCacheManager) -> None:
        """The batch has ended: free every member's blocks."""
        for request in self.requests:
            kv.free(request.request_id)
        self.requests.clear()

    def check_integrity(self, kv: KVCacheManager, unfinished_ids: set[str]) -> None:
        """Raise AssertionError unless every member is finished and still owns its context.

        Args:
            kv: the block tables.
            unfinished_ids: ids of the scheduler's waiting and running requests.
        """
        ids = {r.request_id for r in self.requests}
        assert len(ids) == len(self.requests), "a request is padding twice"
        assert not ids & unfinished_ids, "a padding request is unfinished"
        for request in self.requests:
            assert request.status.finished, f"padding {request.request_id} is not finished"
            assert request.num_computed_tokens >= 1, f"padding {request.request_id} is empty"
            held = len(kv.block_ids(request.request_id)) * kv.block_size
            assert held >= request.num_computed_tokens, f"padding {request.request_id} lost blocks"
