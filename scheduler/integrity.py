"""The scheduler's integrity check, run by tests after every step (``Scheduler.check_integrity``).

It reads the queues and asks kvpool what each request holds; it changes nothing. The
invariants it asserts are listed on ``Scheduler``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvpool.manager import KVCacheManager
from scheduler.padding import BatchPadding
from scheduler.request import Request, RequestStatus


def check_queues(
    kv: KVCacheManager,
    running: Sequence[Request],
    waiting: Sequence[Request],
    tracked_ids: Collection[str],
    padding: BatchPadding,
    *,
    keeps_padding: bool,
) -> None:
    """Raise AssertionError if the queues, statuses or block ownership disagree.

    Args:
        kv: the block tables the scheduler allocates through (checked first).
        running: the running requests.
        waiting: the waiting queue.
        tracked_ids: ids of every unfinished request the scheduler tracks.
        padding: the finished members of the running batch still computed.
        keeps_padding: whether this scheduler keeps padding at all.
    """
    kv.check_integrity()
    running_ids = {r.request_id for r in running}
    waiting_ids = {r.request_id for r in waiting}
    assert len(running_ids) == len(running), "a request is running twice"
    assert len(waiting_ids) == len(waiting), "a request is waiting twice"
    assert not running_ids & waiting_ids, "a request is both running and waiting"
    assert running_ids | waiting_ids == set(tracked_ids), "untracked request"
    for request in running:
        assert request.status == RequestStatus.RUNNING
        held = len(kv.block_ids(request.request_id)) * kv.block_size
        assert held >= request.num_computed_tokens, f"{request.request_id} lost blocks"
    for request in waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert not kv.has_request(request.request_id), f"waiting {request.request_id} holds blocks"
    assert not padding or (keeps_padding and running), "padding outlived its batch"
    padding.check_integrity(kv, running_ids | waiting_ids)
    for request in [*running, *padding.requests]:
        live = kv.num_live_tokens(request.request_id)
        assert live == request.num_computed_tokens, (
            f"{request.request_id}: kvpool counts {live} live tokens, "
            f"{request.num_computed_tokens} computed"
        )
