"""Backpressure: how many requests the server holds, checked before any tokenization.

Every choice of every prompt is one engine request. The engine runs at most ``max_num_seqs``
of them at once; ``--max-waiting-requests`` bounds how many more may wait behind those. A
request that would go past the bound is answered at once with a 503 and ``Retry-After``,
before its prompt is tokenized or templated, so a burst costs the server almost nothing
(vLLM#58192: checking before the preprocessing but counting after it lets a burst pay for
all of it). Two checks, both on the event loop:

* **in flight** (exact, synchronous): engine requests the engine client holds (queued,
  waiting, running, or aborted and not yet confirmed) plus the ones held here and still
  being tokenized must stay within ``max_num_seqs + max_waiting_requests``. This one is what
  a burst meets: it does not depend on when the engine last stepped.
* **waiting** (as of the last step): when KV memory, not ``max_num_seqs``, limits the batch,
  fewer requests run and more wait. If the last step left requests waiting, everything in
  flight beyond the requests it ran is waiting, and that must stay within
  ``max_waiting_requests`` too. The running count lags by at most one step.

* **queue time** (``--max-queue-time``): the requests that would wait ahead of a newcomer,
  over the engine's recent drain rate (requests finished per second while it worked), is
  the newcomer's estimated wait; past the bound it gets 503 + Retry-After at once. The
  estimate is a forecast, so ``GenerationRun`` also enforces the bound: a request still
  without its first token when the bound expires is aborted with the same 503.

A request that needs more engine requests than the server can ever hold (``n`` x prompts
above ``max_num_seqs + max_waiting_requests``) is a 400: retrying could never help.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from server.engine_client import AsyncEngineClient
from server.errors import invalid, queue_too_long, server_overloaded


def count_prompts(prompt: object) -> int:
    """Prompts in a completions ``prompt`` without tokenizing: a string or one list of token
    ids is one prompt, a list of strings or of id lists is one each (at least 1, so an empty
    list still reaches its own 400)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


class Backpressure:
    """Holds room for requests while the server has it; one per app, used on the event loop
    only.

    Args:
        client: the engine client whose in-flight requests count.
        max_num_seqs: the scheduler's batch size.
        max_waiting_requests: engine requests allowed to wait behind the running ones.
    """

    def __init__(
        self,
        client: AsyncEngineClient,
        *,
        max_num_seqs: int,
        max_waiting_requests: int,
        max_queue_time_s: float | None = None,
    ) -> None:
        self._client = client
        self.max_waiting_requests = max_waiting_requests
        self.max_queue_time_s = max_queue_time_s
        self.max_num_seqs = max_num_seqs
        self.capacity = max_num_seqs + max_waiting_requests
        self._num_reserved = 0  # held here, not yet handed to the engine client

    @property
    def num_in_flight(self) -> int:
        return self._client.num_unfinished + self._num_reserved

    @contextlib.contextmanager
    def hold(self, num_requests: int) -> Iterator[None]:
        """Hold room for ``num_requests`` engine requests while the body runs (tokenize,
        then ``GenerationRun.start``); once started, the engine client counts them.

        Raises:
            APIError: 503 + Retry-After when the server is full, 400 when it never could
                hold this many.
        """
        if num_requests > self.capacity:
            raise invalid(
                f"This request needs {num_requests} sequences (n x prompts), more than the "
                f"server ever holds at once ({self.capacity} = max_num_seqs + "
                "--max-waiting-requests); send it in smaller parts.",
                "n",
                "too_many_sequences",
            )
        in_flight = self.num_in_flight
        if in_flight + num_requests > self.capacity or (
            self._num_waiting_after(in_flight + num_requests) > self.max_waiting_requests
        ):
            raise server_overloaded(in_flight, self.capacity)
        if self.max_queue_time_s is not None:
            # Beyond max_num_seqs everything waits, even before a step has seen it (a burst).
            after = in_flight + num_requests
            num_waiting = max(self._num_waiting_after(after), after - self.max_num_seqs)
            wait_s = self._client.estimated_wait_s(num_waiting)
            if wait_s is not None and wait_s > self.max_queue_time_s:
                raise queue_too_long(wait_s, self.max_queue_time_s, waited=False)
        self._num_reserved += num_requests
        try:
            yield
        finally:
            self._num_reserved -= num_requests

    def _num_waiting_after(self, in_flight: int) -> int:
        """Requests that would wait with ``in_flight`` held, judged from the last step.

        If the last step left nobody waiting, a newcomer runs as soon as a slot is free and
        only the in-flight bound applies. If some waited (the batch is bound by KV memory or
        by max_num_seqs), every request beyond the ones running waits too.
        """
        stats = self._client.snapshot.last_step_stats
        if stats is None or stats.num_waiting == 0:
            return 0
        return in_flight - stats.num_running
