"""AsyncEngineClient: the only place where asyncio meets the (synchronous) engine, together
with its engine thread (``server/engine_loop.py``).

Ownership and threads::

    event loop (uvicorn)                          engine thread (owns the LLMEngine)
    ────────────────────                          ─────────────────────────────────
    add(requests) ──┐                              loop:
    abort(ids) ─────┼─> _intake (deque) + Condition ─>  apply adds/aborts (engine.add_request …)
                    │                                   outputs = engine.step()
    RequestStream <─┴── loop.call_soon_threadsafe(_deliver, outputs) <─┘  heartbeat, snapshot

* Only the engine thread calls the engine; it lives in ``server/engine_loop.py``
  (``EngineLoop``: the thread, its intake queue, heartbeat, snapshot, step-failure and
  integrity handling). This module is the event-loop half: it only appends to the intake
  queue and reads per-request ``RequestStream`` collectors, which only the event loop writes
  (``_deliver`` runs there), so neither side needs a lock beyond the intake's condition.
* ``/health`` reads what the thread publishes: "alive and idle" (a fresh heartbeat), "stuck
  inside a step" (a stale one) and "dead" (thread gone, or the loop crashed).
* If the engine thread dies (an integrity check fails, the engine cannot abort after a failed
  step, or the loop itself crashes), the client is marked dead at once: every open stream
  gets an error, ``/health`` answers 503 from then on, and every later ``add`` raises
  ``EngineUnavailableError`` (a 503) instead of waiting on a loop that will never answer.

Why a thread and not a process. The model's forward pass runs inside torch ops that release
the GIL, so the event loop gets the GIL for most of a step; only the engine's Python-side work
(scheduling, building the batch) competes with HTTP handling. A process would remove that
contention but adds an IPC hop for every step's token stream (vLLM's ZMQ front end) and a
second copy of the tokenizer. ``python -m benchmarks.engine_thread`` measures both sides; on the 2-core
CPU build box (default model, 32 greedy requests x 32 tokens, OMP_NUM_THREADS=1, other jobs
running) it gave: engine alone 73.9 tokens/s (433 ms/step); engine thread + asyncio consumers
detokenizing every stream 72.7 tokens/s (440 ms/step, -1.6%), event-loop lag p50 0.16 ms,
p99 5.9 ms, max 15 ms; a process split would add 0.26-0.58 ms of pipe round trip per step
(0.1% of a CPU step). Both costs are noise on CPU, so the simpler thread wins. On a GPU a step
is ~100x shorter and the GIL share grows; re-run the bench there before deciding otherwise.
Per STYLE 4, moving the engine into a process changes only this file and engine_loop.py: the
public surface (``submit`` + ``confirm`` or ``add`` / ``abort`` / ``health`` / ``snapshot``;
types in server/engine_types.py) stays.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from engine.outputs import RequestOutput, StepStats
from server.engine_loop import EngineLoop, error_output
from server.engine_types import (
    EngineHealth,
    EngineLike,
    EngineRequest,
    EngineSnapshot,
    EngineUnavailableError,
    RequestStream,
    Submission,
)

# Re-exported: the server and its tests import these from here.
__all__ = [
    "AsyncEngineClient",
    "EngineHealth",
    "EngineLike",
    "EngineRequest",
    "EngineSnapshot",
    "EngineUnavailableError",
    "RequestStream",
    "Submission",
]

logger = logging.getLogger(__name__)


class AsyncEngineClient:
    """Runs one engine on one thread and bridges it to asyncio.

    Args:
        engine: the engine; from ``start()`` on, only the engine thread touches it.
        stall_timeout_s: a heartbeat older than this makes the engine unhealthy.
        check_integrity: call ``engine.check_integrity()`` after every step (debug).
        idle_wake_s: how often an idle engine thread wakes to refresh its heartbeat.

    ``on_step`` (set before ``start()``, by ``create_app``) is called on the event loop with
    every step's ``StepStats``: the metrics hook.
    """

    def __init__(
        self,
        engine: EngineLike,
        *,
        stall_timeout_s: float = 60.0,
        check_integrity: bool = False,
        idle_wake_s: float = 0.5,
    ) -> None:
        # Read-only facts, copied before the engine thread exists, so handlers never touch
        # the engine object.
        self.tokenizer: Any = engine.tokenizer
        self.model_id: str = engine.model_id
        self.max_model_len: int = engine.max_model_len
        self.eos_token_id: int | None = engine.eos_token_id
        self.vocab_size: int = int(engine.model_config.vocab_size)
        self._stall_timeout_s = stall_timeout_s
        self.on_step: Callable[[StepStats], None] | None = None
        self._engine_loop = EngineLoop(
            engine,
            check_integrity=check_integrity,
            idle_wake_s=idle_wake_s,
            deliver=self._deliver,
            fail_streams=self._fail_streams,
        )
        # Event-loop only: request id -> its stream.
        self._streams: dict[str, RequestStream] = {}

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs.

        Idempotent for the same loop (the app lifespan and tests may both call it).
        """
        loop = asyncio.get_running_loop()
        engine_loop = self._engine_loop
        if engine_loop.thread is not None:
            if engine_loop.event_loop is not loop:
                raise RuntimeError("AsyncEngineClient is already bound to another event loop")
            return
        engine_loop.start(loop)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread after its current step; open streams end with an error."""
        self._engine_loop.stop()
        thread = self._engine_loop.thread
        if thread is not None:
            await asyncio.to_thread(thread.join, timeout_s)
        self._fail_streams("the server is shutting down")

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._engine_loop.snapshot

    @property
    def num_unfinished(self) -> int:
        """Engine requests handed to ``add`` whose final output has not been delivered yet
        (queued, waiting, running, or aborted and not yet confirmed): what occupies the
        engine, as the event loop sees it."""
        return len(self._streams)

    @property
    def is_stopping(self) -> bool:
        """``shutdown()`` was called: open streams end because the server is going away."""
        return self._engine_loop.stopping

    def health(self) -> EngineHealth:
        engine_loop = self._engine_loop
        now = time.monotonic()
        age = now - engine_loop.heartbeat
        reason: str | None = None
        if engine_loop.dead_reason is not None:
            reason = f"engine loop died: {engine_loop.dead_reason}"
        elif engine_loop.thread is None:
            reason = "engine loop not started"
        elif not engine_loop.thread.is_alive():
            reason = "engine loop thread exited"
        elif age > self._stall_timeout_s:
            stuck = engine_loop.in_step_since
            where = f" inside a step for {now - stuck:.1f}s" if stuck is not None else ""
            reason = f"engine loop stalled: no iteration for {age:.1f}s{where}"
        return EngineHealth(reason is None, reason, age, engine_loop.snapshot)

    def submit(
        self, requests: Sequence[EngineRequest], arrival_time: float | None = None
    ) -> Submission:
        """Queue requests as one unit, synchronously: from here on ``num_unfinished`` counts
        them (admission control relies on that). ``confirm`` waits for the engine's answer.

        Raises:
            ValueError: duplicate request ids.
            EngineUnavailableError: the engine loop is dead or stalled.
        """
        health = self.health()
        if not health.healthy:
            raise EngineUnavailableError(health.reason or "unavailable")
        loop = self._engine_loop.event_loop
        assert loop is not None
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids) or any(i in self._streams for i in ids):
            raise ValueError(f"duplicate request id among {ids}")
        stream = RequestStream(ids)
        # Register before queueing: outputs may be delivered before the ack below resolves.
        for request_id in ids:
            self._streams[request_id] = stream
        future: asyncio.Future[None] = loop.create_future()
        try:
            self._engine_loop.add(requests, arrival_time, future)
        except EngineUnavailableError:
            self._forget(ids)
            raise
        return Submission(stream, future)

    async def confirm(self, submission: Submission) -> RequestStream:
        """Wait until the engine took the submitted requests; return their stream.

        Raises:
            ValueError: the engine refused a request (it can never run); none of them stay.
            EngineUnavailableError: the engine loop died before taking them.
        """
        try:
            await submission.future
        except BaseException:
            self._forget(submission.stream.request_ids)
            # Cancelled (client gone, deadline) or refused: whatever the engine took or will
            # take must go. An abort of ids it never added is a no-op.
            self.abort(submission.stream.request_ids)
            raise
        return submission.stream

    async def add(
        self, requests: Sequence[EngineRequest], arrival_time: float | None = None
    ) -> RequestStream:
        """``submit`` then ``confirm``: the stream, once the engine accepted the requests."""
        return await self.confirm(self.submit(requests, arrival_time))

    def _forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Ask the engine to abort; idempotent, unknown or finished ids are ignored."""
        ids = list(request_ids)
        if ids:
            self._engine_loop.abort(ids)

    def _deliver(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        """Event loop: route outputs to their streams (runs via call_soon_threadsafe)."""
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream._put(output)
            if output.finished:
                del self._streams[output.request_id]
        if stats is not None and self.on_step is not None:
            try:
                self.on_step(stats)
            except Exception:  # metrics must never break serving
                logger.exception("on_step hook failed")

    def _fail_streams(self, message: str) -> None:
        """Event loop: end every open stream with an error output."""
        for request_id, stream in list(self._streams.items()):
            stream._put(error_output(request_id, message))
        self._streams.clear()
