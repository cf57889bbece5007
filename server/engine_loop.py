"""EngineLoop: the engine thread, the only code that calls the engine.

``server/engine_client.py`` (the event-loop half) hands it work through ``add`` / ``abort``
and reads what it publishes; it hands outputs back through the two callbacks it was built
with, which it posts to the event loop with ``call_soon_threadsafe``.

* The intake (a deque of adds and aborts) is the only state both threads write; its
  condition guards it, with ``stopping`` and ``closed``.
* The thread sleeps on that condition when there is no work (no busy spin) and wakes every
  ``idle_wake_s`` to refresh ``heartbeat``, so ``/health`` can tell "alive and idle" from
  "stuck inside a step" (``in_step_since``) and from "dead" (``dead_reason``, thread gone).
* A request whose computation raises is failed by the engine itself, alone
  (``finish_reason="error"``; engine/faults.py). If ``engine.step()`` raises anyway (the
  scheduler failed, so no single request can be blamed), every request in flight is aborted
  in the engine (blocks returned) and finishes with ``"error"``, then the engine's
  ``check_integrity()`` must hold for the loop to go on serving.
* If that check fails, the engine cannot abort, or the loop itself crashes, the loop closes
  its intake, fails every add still queued with ``EngineUnavailableError`` and asks the event
  loop to fail every open stream.
* Each time the engine goes idle (no request left), the thread runs ``check_integrity()``
  once and publishes the step it checked at in ``snapshot``; a violation is fatal, because a
  corrupt pool would serve wrong tokens or leak blocks from then on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.outputs import RequestOutput, StepStats
from server.engine_types import (
    EngineLike,
    EngineRequest,
    EngineSnapshot,
    EngineUnavailableError,
)

# The engine client's logger: this thread is its other half, and operators filter on it.
logger = logging.getLogger("server.engine_client")


@dataclass(slots=True)
class _Add:
    requests: Sequence[EngineRequest]
    arrival_time: float | None
    future: asyncio.Future[None]


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


class EngineLoop:
    """The engine thread and its intake queue.

    Args:
        engine: the engine; from ``start()`` on, only this thread touches it.
        check_integrity: call ``engine.check_integrity()`` after every step (debug).
        idle_wake_s: how often an idle thread wakes to refresh its heartbeat.
        deliver: run on the event loop with each iteration's outputs and step stats.
        fail_streams: run on the event loop with a message when the loop dies.

    ``heartbeat``, ``in_step_since``, ``dead_reason`` and ``snapshot`` are written by the
    thread and read by the event loop: single reference/float assignments, no lock.
    """

    def __init__(
        self,
        engine: EngineLike,
        *,
        check_integrity: bool,
        idle_wake_s: float,
        deliver: Callable[[list[RequestOutput], StepStats | None], None],
        fail_streams: Callable[[str], None],
    ) -> None:
        self.engine = engine
        self._check_integrity = check_integrity
        self._idle_wake_s = idle_wake_s
        self._deliver = deliver
        self._fail_streams = fail_streams

        self._cond = threading.Condition()
        self._intake: deque[_Add | _Abort] = deque()  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._closed = False  # guarded by _cond: the loop is gone, nothing will take intake
        self.thread: threading.Thread | None = None
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.heartbeat = time.monotonic()
        self.in_step_since: float | None = None
        self.dead_reason: str | None = None
        self.snapshot = EngineSnapshot(
            num_free_blocks=engine.num_free_blocks, num_total_blocks=engine.num_total_blocks
        )
        # Engine-thread only: ids added to the engine and not finished yet.
        self._active: set[str] = set()

    # ------------------------------------------------------------------ event-loop side

    def start(self, event_loop: asyncio.AbstractEventLoop) -> None:
        """Start the thread; its outputs go to ``event_loop``."""
        self.event_loop = event_loop
        self.heartbeat = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Ask the thread to return after its current step."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def add(
        self,
        requests: Sequence[EngineRequest],
        arrival_time: float | None,
        future: asyncio.Future[None],
    ) -> None:
        """Queue requests as one unit; ``future`` resolves once the engine took or refused
        them.

        Raises:
            EngineUnavailableError: the loop has died (queueing would wait forever).
        """
        self._enqueue(_Add(requests, arrival_time, future))

    def abort(self, request_ids: list[str]) -> None:
        """Queue an abort; dropped if the loop has died (it already failed every request)."""
        self._enqueue(_Abort(request_ids))

    def _enqueue(self, item: _Add | _Abort) -> None:
        with self._cond:
            if self._closed:
                # The loop died after the client's health check: queueing would wait forever.
                if isinstance(item, _Add):
                    raise EngineUnavailableError(self.dead_reason or "engine loop exited")
                return
            self._intake.append(item)
            self._cond.notify()

    # ------------------------------------------------------------------ engine thread

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        assert self.event_loop is not None
        try:
            self.event_loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        try:
            self._serve_forever()
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
            self.dead_reason = f"{type(exc).__name__}: {exc}"
            logger.critical("engine loop crashed:\n%s", traceback.format_exc())
            with self._cond:
                self._closed = True
                pending, self._intake = list(self._intake), deque()
            error = EngineUnavailableError(self.dead_reason)
            for item in pending:
                if isinstance(item, _Add):
                    self._post(_set_future, item.future, error)
            self._post(self._fail_streams, f"engine loop died: {self.dead_reason}")

    def _serve_forever(self) -> None:
        engine = self.engine
        has_work = False
        num_steps = 0
        checked_at: int | None = None
        # perf_counter() when the last step returned, while there has been work ever since:
        # the time until the next step starts is the "between_steps" phase of that step.
        last_step_end: float | None = None
        while True:
            with self._cond:
                while not self._intake and not self._stopping and not has_work:
                    self.heartbeat = time.monotonic()
                    self._cond.wait(self._idle_wake_s)
                if self._stopping:
                    return
                intake, self._intake = self._intake, deque()

            outputs: list[RequestOutput] = []
            for item in intake:
                outputs.extend(self._apply(item))

            stats: StepStats | None = None
            if engine.has_unfinished_requests():
                self.in_step_since = time.monotonic()
                step_start = time.perf_counter()
                try:
                    outputs.extend(engine.step())
                    stats = engine.last_step_stats
                    if stats is not None and last_step_end is not None:
                        stats.phase_s["between_steps"] = step_start - last_step_end
                except Exception as exc:
                    logger.error(
                        "engine step failed; failing %d request(s) in flight:\n%s",
                        len(self._active),
                        traceback.format_exc(),
                    )
                    outputs.extend(self._fail_active(f"{type(exc).__name__}: {exc}"))
                    # Serving on is only safe if the failure left the pool consistent.
                    engine.check_integrity()  # AssertionError here is fatal on purpose
                finally:
                    self.in_step_since = None
                    last_step_end = time.perf_counter()
                num_steps += 1
                if self._check_integrity:
                    engine.check_integrity()  # AssertionError here is fatal on purpose

            for output in outputs:
                if output.finished:
                    self._active.discard(output.request_id)
            has_work = engine.has_unfinished_requests()
            if not has_work:
                last_step_end = None  # idle time is nobody's overhead
            if not has_work and checked_at != num_steps:
                # Idle: every request is finished, so the whole pool must be consistent (and
                # free); cheap now, and what /health reports to tests and operators.
                engine.check_integrity()  # AssertionError here is fatal on purpose
                checked_at = num_steps
            self.snapshot = EngineSnapshot(
                num_steps=num_steps,
                num_requests=len(self._active),
                num_free_blocks=engine.num_free_blocks,
                num_total_blocks=engine.num_total_blocks,
                last_step_stats=stats if stats is not None else self.snapshot.last_step_stats,
                integrity_checked_at_step=checked_at,
            )
            self.heartbeat = time.monotonic()
            # Delivered now, though the event loop then usually takes the GIL first and this
            # thread waits for it ("between_steps": ~0.5 ms a token at batch 1 on 2 cores).
            # Posting instead when the next step's forward starts (torch ops release the GIL)
            # cut that to 0.02 ms but the event loop's work then ran beside the forward's two
            # threads: TPOT p50 5.34-5.77 -> 5.46-6.21 ms (default model, concurrency 1,
            # three alternating rounds).
            if outputs or stats is not None:
                self._post(self._deliver, outputs, stats)

    def _apply(self, item: _Add | _Abort) -> list[RequestOutput]:
        """Engine thread: apply one intake item; return outputs to deliver."""
        engine = self.engine
        if isinstance(item, _Abort):
            ids = [r for r in item.request_ids if r in self._active]
            return engine.abort_request(ids) if ids else []
        added: list[str] = []
        try:
            for request in item.requests:
                engine.add_request(
                    request.request_id,
                    list(request.prompt_token_ids),
                    request.params,
                    item.arrival_time,
                )
                added.append(request.request_id)
        except Exception as exc:  # ValueError: the request can never run -> the client's 400
            if added:
                engine.abort_request(added)  # all-or-nothing: n>1 choices go in together
            self._post(_set_future, item.future, exc)
            return []
        self._active.update(added)
        self._post(_set_future, item.future, None)
        return []

    def _fail_active(self, message: str) -> list[RequestOutput]:
        """Engine thread: after a failed step, abort everything in flight as an error."""
        ids = sorted(self._active)
        aborted = {o.request_id: o for o in self.engine.abort_request(ids)}
        failed = []
        for request_id in ids:
            output = aborted.get(request_id)
            if output is None:
                failed.append(error_output(request_id, message))
            else:
                failed.append(
                    dataclasses.replace(output, finished=True, finish_reason="error", error=message)
                )
        return failed


def _set_future(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the waiter was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def error_output(request_id: str, message: str) -> RequestOutput:
    """A final output that fails ``request_id`` with ``message`` (``finish_reason="error"``)."""
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_logprobs=None,
        finished=True,
        finish_reason="error",
        num_prompt_tokens=0,
        num_output_tokens=0,
        error=message,
    )
