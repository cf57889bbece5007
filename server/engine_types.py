"""What crosses the engine client's boundary: the engine's interface, requests, snapshots,
health, and the per-request output streams the event loop reads (server/engine_client.py,
the client and its engine thread, sits between them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from engine.outputs import RequestOutput, StepStats
from kvpool.storage import KVCapacity
from scheduler.request import SamplingParams


class EngineUnavailableError(RuntimeError):
    """The engine loop is dead or stalled; the request was not queued."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the engine thread last saw, published after every loop iteration."""

    num_steps: int = 0
    num_requests: int = 0  # requests added and not finished, as the engine thread tracks them
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    last_step_stats: StepStats | None = None
    # num_steps at the last idle check (check_idle()) that passed; None before the first one.
    integrity_checked_at_step: int | None = None
    # The pool's size (fixed at start-up): what /health reports of the KV cache.
    kv_capacity: KVCapacity | None = None

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks


@dataclass(frozen=True, slots=True)
class EngineHealth:
    healthy: bool
    reason: str | None  # why not healthy
    heartbeat_age_s: float
    snapshot: EngineSnapshot


class RequestStream:
    """Outputs of the engine requests of one HTTP request (its n choices × prompts).

    Written only by the event loop (``_put``) and read by the route handler; ``get`` returns
    every output that arrived since the last call, in engine order, so a slow consumer gets
    several steps at once instead of falling behind one step per wake-up.
    """

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids: tuple[str, ...] = tuple(request_ids)
        self._unfinished = set(request_ids)
        self._pending: list[RequestOutput] = []
        self._ready = asyncio.Event()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    @property
    def unfinished_ids(self) -> list[str]:
        return [r for r in self.request_ids if r in self._unfinished]

    def _put(self, output: RequestOutput) -> None:
        if output.request_id not in self._unfinished:
            return  # a late output (e.g. an abort after an error) for a finished request
        if output.finished:
            self._unfinished.discard(output.request_id)
        self._pending.append(output)
        self._ready.set()

    async def get(self) -> list[RequestOutput]:
        """Wait for outputs; ``[]`` means every request of the stream has finished."""
        while not self._pending:
            if not self._unfinished:
                return []
            self._ready.clear()
            await self._ready.wait()
        batch, self._pending = self._pending, []
        return batch


@dataclass(frozen=True, slots=True)
class Submission:
    """Requests handed to the engine thread, not yet acknowledged (``confirm`` waits)."""

    stream: RequestStream
    future: asyncio.Future[None]
