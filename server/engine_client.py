"""AsyncEngineClient and its engine thread: the only place where asyncio meets the
(synchronous) engine.

Ownership and threads::

    event loop (uvicorn)                          engine thread (owns the LLMEngine)
    ────────────────────                          ─────────────────────────────────
    add(requests) ──┐                              loop:
    abort(ids) ─────┼─> _intake (deque) + Condition ─>  apply adds/aborts (engine.add_request …)
                    │                                   outputs = engine.step()
    RequestStream <─┴── loop.call_soon_threadsafe(_deliver, outputs) <─┘  heartbeat, snapshot

Two halves, one concept. ``AsyncEngineClient`` is the event-loop half: it only appends to
the intake queue and reads per-request ``RequestStream`` collectors, which only the event
loop writes (``_deliver`` runs there). ``EngineLoop`` is the thread half, the only code that
calls the engine: its intake queue, heartbeat, snapshot, step-failure and integrity
handling. Neither side needs a lock beyond the intake's condition.

* The intake (a deque of adds and aborts) is the only state both threads write; its
  condition guards it, with ``stopping`` and ``closed``.
* The thread sleeps on that condition when there is no work (no busy spin) and wakes every
  ``idle_wake_s`` to refresh ``heartbeat``, so ``/health`` can tell "alive and idle" (a fresh
  heartbeat) from "stuck inside a step" (``in_step_since``) and from "dead" (``dead_reason``,
  thread gone).
* A request whose computation raises is failed by the engine itself, alone
  (``finish_reason="error"``; engine/faults.py). If ``engine.step()`` raises anyway (the
  scheduler failed, so no single request can be blamed), every request in flight is aborted
  in the engine (blocks returned) and finishes with ``"error"``, then the engine's
  ``check_integrity()`` must hold for the loop to go on serving.
* Each time the engine goes idle (no request left), the thread runs ``check_idle()`` once
  (nothing left: every KV block back in the pool, no request state; constant time) and
  publishes the step it checked at in ``snapshot``; a violation is fatal, because a corrupt
  pool would serve wrong tokens or leak blocks from then on. ``--check-integrity`` adds the
  whole ``check_integrity()`` (every block, every table) after every step.
* If the engine thread dies (an integrity check fails, the engine cannot abort after a failed
  step, or the loop itself crashes), it closes its intake and fails every add still queued,
  and the client is marked dead at once: every open stream gets an error, ``/health`` answers
  503 from then on, and every later ``add`` raises ``EngineUnavailableError`` (a 503) instead
  of waiting on a loop that will never answer.

Why a thread and not a process. The model's forward pass runs inside torch ops that release
the GIL, so the event loop gets the GIL for most of a step; only the engine's Python-side work
(scheduling, building the batch) competes with HTTP handling. A process would remove that
contention but adds an IPC hop for every step's token stream (vLLM's ZMQ front end) and a
second copy of the tokenizer. ``python -m benchmarks.engine_thread`` measures both sides: on
CPU, the thread's cost to throughput and the event loop's lag, and the pipe round trip a
process would add, were all noise beside a step (benchmarks/RESULTS.md), so the simpler thread
wins. On a GPU a step is far shorter and the GIL's share grows; rerun it there before
deciding otherwise. Moving the engine into a process changes only this file: its public
surface (``submit`` + ``confirm`` or ``add`` / ``abort`` / ``health`` / ``snapshot``; the
types in server/engine_types.py) stays.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.faults import EngineFatalError
from engine.generation_config import SamplingDefaults
from engine.outputs import EngineOccupancy, RequestOutput, StepStats
from engine.protocol import ServingEngine
from server.engine_types import (
    EngineHealth,
    EngineRequest,
    EngineSnapshot,
    EngineUnavailableError,
    RequestStream,
    Submission,
)

logger = logging.getLogger(__name__)


class DrainRate:
    """Requests the engine finished per second recently, while it had work: what a new
    request's wait in the queue is estimated from (``--max-queue-time``).

    Each delivered step adds ``(time, requests finished)``. The window holds the last
    ``window_s`` seconds of steps; a gap longer than ``idle_gap_s`` between two steps means
    the engine was idle, and the window starts over, so idle time never counts as slowness.
    """

    def __init__(
        self, window_s: float = 30.0, idle_gap_s: float = 5.0, min_finished: int = 4
    ) -> None:
        self.window_s = window_s
        self.idle_gap_s = idle_gap_s
        self.min_finished = min_finished
        self._steps: deque[tuple[float, int]] = deque()

    def on_step(self, now: float, num_finished: int) -> None:
        steps = self._steps
        if steps and now - steps[-1][0] > self.idle_gap_s:
            steps.clear()
        steps.append((now, num_finished))
        while now - steps[0][0] > self.window_s:
            steps.popleft()

    def rate(self) -> float | None:
        """Requests per second; None until the window holds ``min_finished`` finishes or
        spans a second (a burst on an idle engine is judged as soon as a few finish)."""
        steps = self._steps
        if len(steps) < 2:
            return None
        span = steps[-1][0] - steps[0][0]
        # The first step opens the window; the finishes counted are the ones after it.
        num_finished = sum(n for _, n in steps) - steps[0][1]
        if span <= 0 or (span < 1.0 and num_finished < self.min_finished):
            return None
        return num_finished / span


class AsyncEngineClient:
    """Runs one engine on one thread and bridges it to asyncio.

    Args:
        engine: the engine; from ``start()`` on, only the engine thread touches it.
        stall_timeout_s: a heartbeat older than this makes the engine unhealthy.
        check_integrity: call ``engine.check_integrity()`` after every step (debug).
        idle_wake_s: how often an idle engine thread wakes to refresh its heartbeat.

    ``on_step`` (set before ``start()``, by ``create_app``) is called on the event loop with
    every step's ``StepStats``, and ``on_idle`` with the ``EngineOccupancy`` of each moment
    the engine goes idle (after the outputs that emptied it): the metrics hooks. The last
    step's stats do not always say idle: aborts empty the engine without a step, and with
    asynchronous scheduling the call that delivers the last tokens computes no step.
    """

    def __init__(
        self,
        engine: ServingEngine,
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
        self.sampling_defaults: SamplingDefaults = engine.sampling_defaults
        self.vocab_size: int = int(engine.model_config.vocab_size)
        # Thread-safe: handlers compile grammars here before queueing (server/structured.py).
        self.grammars: Any = getattr(engine, "grammars", None)
        self._stall_timeout_s = stall_timeout_s
        self.on_step: Callable[[StepStats], None] | None = None
        self.on_idle: Callable[[EngineOccupancy], None] | None = None
        self._engine_loop = EngineLoop(
            engine,
            check_integrity=check_integrity,
            idle_wake_s=idle_wake_s,
            deliver=self._deliver,
            fail_streams=self._fail_streams,
        )
        # Event-loop only: request id -> its stream.
        self._streams: dict[str, RequestStream] = {}
        self.drain_rate = DrainRate()  # event loop only

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

    def estimated_wait_s(self, num_waiting: int) -> float | None:
        """Seconds until ``num_waiting`` requests ahead in the queue have drained at the
        recent drain rate; None while no rate is known yet."""
        if num_waiting <= 0:
            return 0.0
        rate = self.drain_rate.rate()
        if rate is None:
            return None
        return num_waiting / rate if rate > 0 else float("inf")

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
        them (backpressure relies on that). ``confirm`` waits for the engine's answer.

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

    def _deliver(
        self,
        outputs: list[RequestOutput],
        stats: StepStats | None,
        idle: EngineOccupancy | None = None,
    ) -> None:
        """Event loop: route outputs to their streams (runs via call_soon_threadsafe)."""
        num_finished = 0
        for output in outputs:
            # Aborts and failures say nothing about how fast the engine serves.
            num_finished += output.finished and output.finish_reason not in ("abort", "error")
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream._put(output)
            if output.finished:
                del self._streams[output.request_id]
        # A step() call that computed no step may still finish requests (asynchronous
        # scheduling reads the step before): they count, though the call has no figures.
        if stats is not None or num_finished:
            self.drain_rate.on_step(time.monotonic(), num_finished)
        if stats is not None and self.on_step is not None:
            try:
                self.on_step(stats)
            except Exception:  # metrics must never break serving
                logger.exception("on_step hook failed")
        if idle is not None and self.on_idle is not None:
            try:
                self.on_idle(idle)
            except Exception:
                logger.exception("on_idle hook failed")

    def _fail_streams(self, message: str) -> None:
        """Event loop: end every open stream with an error output."""
        for request_id, stream in list(self._streams.items()):
            stream._put(error_output(request_id, message))
        self._streams.clear()


# ------------------------------------------------------------------------------------ engine thread


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
        deliver: run on the event loop with each iteration's outputs, its step's stats and,
            when the engine went idle in it, the idle occupancy.
        fail_streams: run on the event loop with a message when the loop dies.

    ``heartbeat``, ``in_step_since``, ``dead_reason`` and ``snapshot`` are written by the
    thread and read by the event loop: single reference/float assignments, no lock.
    """

    def __init__(
        self,
        engine: ServingEngine,
        *,
        check_integrity: bool,
        idle_wake_s: float,
        deliver: Callable[[list[RequestOutput], StepStats | None, EngineOccupancy | None], None],
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
            num_free_blocks=engine.num_free_blocks,
            num_total_blocks=engine.num_total_blocks,
            kv_capacity=engine.kv_capacity,
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
        # The engine's last step figures already delivered: a step() call that computes no
        # step (nothing could run, or it only read the step in flight, as asynchronous
        # scheduling's last call does) leaves them in place, and they must count once.
        seen_stats: StepStats | None = None
        while True:
            with self._cond:
                while not self._intake and not self._stopping and not has_work:
                    if engine.fatal_error is not None:  # e.g. a tensor-parallel rank died
                        raise EngineFatalError(engine.fatal_error)
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
                    if stats is seen_stats:
                        stats = None
                    else:
                        seen_stats = stats
                    if stats is not None and last_step_end is not None:
                        stats.phase_s["between_steps"] = step_start - last_step_end
                except EngineFatalError:
                    raise  # the engine cannot step again (a tensor-parallel rank is gone)
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
            idle: EngineOccupancy | None = None
            if not has_work and checked_at != num_steps:
                # Idle: every request is finished, so nothing may be left (a block still
                # owned is a leak); what /health reports to tests and operators. The check
                # takes constant time: the next request may already be waiting, and walking
                # a GPU's whole pool here held the GIL for milliseconds to tens of them
                # (--check-integrity walks it after every step).
                engine.check_idle()  # AssertionError here is fatal on purpose
                checked_at = num_steps
                idle = engine.occupancy()  # no request left: constant time
            self.snapshot = EngineSnapshot(
                num_steps=num_steps,
                num_requests=len(self._active),
                num_free_blocks=engine.num_free_blocks,
                num_total_blocks=engine.num_total_blocks,
                last_step_stats=stats if stats is not None else self.snapshot.last_step_stats,
                integrity_checked_at_step=checked_at,
                kv_capacity=self.snapshot.kv_capacity,
            )
            self.heartbeat = time.monotonic()
            # Delivered now, though the event loop then usually takes the GIL first and this
            # thread waits for it (the "between_steps" phase). Posting instead when the next
            # step's forward starts (torch ops release the GIL) shrinks that wait, but the
            # event loop's work then runs beside the forward's threads, and batch-1 TPOT got
            # worse, not better (benchmarks/RESULTS.md).
            if outputs or stats is not None or idle is not None:
                self._post(self._deliver, outputs, stats, idle)

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
