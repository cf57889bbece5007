"""When requests are sent: closed loop (fixed concurrency) and open loop (timed arrivals).

- **Closed loop** at concurrency C: C workers, each sends its next request as soon as its
  previous one finishes. Load adapts to the server (a slow server gets fewer requests), so it
  measures capacity: throughput at a given number of in-flight requests.
- **Open loop**: requests are sent at pre-drawn times whatever the server does, as real users
  arrive. Inter-arrival gaps are gamma-distributed with mean 1/rate and shape ``burstiness``
  (the convention of vLLM's ``--burstiness``): 1.0 is a Poisson process, < 1 is burstier
  (coefficient of variation 1/sqrt(burstiness)), > 1 is more regular. This is the mode that
  exposes queueing: past the server's capacity, waiting time (and so TTFT) grows without bound.

Both stop issuing new requests at ``stop_at`` (a ``loop.time()`` deadline); requests already
sent are left to finish (the runner bounds that with its drain timeout).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from loadtest.workloads import RequestSpec

SendFn = Callable[[RequestSpec], Awaitable[None]]


def arrival_offsets(
    num_requests: int, rate: float, burstiness: float, rng: random.Random
) -> list[float]:
    """Send times (seconds after the start) for an open-loop run.

    Args:
        num_requests: number of times to draw.
        rate: mean requests per second; ``math.inf`` sends everything at t=0.
        burstiness: gamma shape of the gaps; 1.0 is Poisson.
        rng: seeded generator (the same seed gives the same schedule).

    Returns:
        Non-decreasing offsets; the first request goes at 0.
    """
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    # Gamma(shape=k, scale=1/(rate*k)) has mean 1/rate for every k; k=1 is exponential.
    scale = 1.0 / (rate * burstiness)
    offsets: list[float] = []
    t = 0.0
    for i in range(num_requests):
        if i > 0:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets


@dataclass(slots=True)
class InFlight:
    """Counts requests in flight and remembers the peak (reported as max_concurrency)."""

    current: int = 0
    peak: int = 0

    def enter(self) -> None:
        self.current += 1
        self.peak = max(self.peak, self.current)

    def exit(self) -> None:
        self.current -= 1


async def run_closed_loop(
    specs: Sequence[RequestSpec], concurrency: int, send: SendFn, stop_at: float
) -> None:
    """Send ``specs`` in order with exactly ``concurrency`` workers (fewer at the tail).

    NOTE: the next request is taken only after the worker's previous one has finished, so at
    most ``concurrency`` requests are ever in flight.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    loop = asyncio.get_running_loop()
    queue = iter(specs)  # shared iterator: workers take turns; no locking needed in asyncio

    async def worker() -> None:
        for spec in queue:
            if loop.time() >= stop_at:
                return
            await send(spec)

    workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(specs)))]
    await _gather_or_cancel(workers)


async def run_open_loop(
    specs: Sequence[RequestSpec],
    offsets: Sequence[float],
    send: SendFn,
    stop_at: float,
    max_concurrency: int | None = None,
) -> None:
    """Send ``specs[i]`` at ``start + offsets[i]`` regardless of how the server keeps up.

    Args:
        specs: requests, in send order.
        offsets: send times relative to the call, seconds (same length as ``specs``).
        send: coroutine that performs one request.
        stop_at: ``loop.time()`` after which no new request is sent.
        max_concurrency: optional client-side cap on requests in flight (as vLLM's
            ``--max-concurrency``); arrivals beyond it wait, and their latency is measured
            from when they are actually sent.
    """
    if len(offsets) != len(specs):
        raise ValueError("offsets and specs must have the same length")
    loop = asyncio.get_running_loop()
    start = loop.time()
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(spec: RequestSpec) -> None:
        if limit is None:
            await send(spec)
            return
        async with limit:
            await send(spec)

    tasks: list[asyncio.Task[None]] = []
    try:
        for spec, offset in zip(specs, offsets, strict=True):
            due = start + offset
            if due >= stop_at:
                break
            # Sleep to an absolute time so scheduling jitter does not accumulate.
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(spec)))
    except asyncio.CancelledError:
        await _cancel_all(tasks)
        raise
    await _gather_or_cancel(tasks)


async def _gather_or_cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Wait for all tasks; if we are cancelled (or one fails), cancel the rest and re-raise."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        await _cancel_all(tasks)
        raise


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    # return_exceptions: collect the children's CancelledErrors instead of raising them.
    await asyncio.gather(*tasks, return_exceptions=True)
