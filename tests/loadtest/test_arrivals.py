from __future__ import annotations

import asyncio
import math
import random
import statistics

import pytest

from loadtest.arrivals import InFlight, arrival_offsets, run_closed_loop, run_open_loop
from loadtest.workloads import RequestSpec


def specs(n: int) -> list[RequestSpec]:
    return [RequestSpec(index=i, prompt="p", prompt_len=1, max_tokens=1) for i in range(n)]


def gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def test_poisson_rate_and_variability() -> None:
    offsets = arrival_offsets(20000, rate=4.0, burstiness=1.0, rng=random.Random(0))
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    g = gaps(offsets)
    assert (len(offsets) - 1) / offsets[-1] == pytest.approx(4.0, rel=0.03)
    # Exponential gaps: coefficient of variation 1.
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_keeps_rate_changes_burstiness(burstiness: float) -> None:
    offsets = arrival_offsets(20000, rate=2.0, burstiness=burstiness, rng=random.Random(1))
    g = gaps(offsets)
    assert statistics.fmean(g) == pytest.approx(0.5, rel=0.05)
    cv = statistics.pstdev(g) / statistics.fmean(g)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_schedule_is_reproducible_and_inf_rate_is_immediate() -> None:
    a = arrival_offsets(100, 3.0, 1.0, random.Random(9))
    assert a == arrival_offsets(100, 3.0, 1.0, random.Random(9))
    assert arrival_offsets(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_offsets(5, 0.0, 1.0, random.Random(0))


async def test_closed_loop_never_exceeds_concurrency() -> None:
    gauge = InFlight()
    sent: list[int] = []
    rng = random.Random(0)

    async def send(spec: RequestSpec) -> None:
        gauge.enter()
        sent.append(spec.index)
        await asyncio.sleep(rng.uniform(0.0, 0.004))
        gauge.exit()

    loop = asyncio.get_running_loop()
    await run_closed_loop(specs(60), 4, send, stop_at=loop.time() + 30)
    assert gauge.peak == 4  # reached, never exceeded
    assert sorted(sent) == list(range(60)) and gauge.current == 0


async def test_closed_loop_stops_issuing_at_deadline() -> None:
    async def send(spec: RequestSpec) -> None:
        await asyncio.sleep(0.02)

    loop = asyncio.get_running_loop()
    count = 0

    async def counting(spec: RequestSpec) -> None:
        nonlocal count
        count += 1
        await send(spec)

    await run_closed_loop(specs(1000), 2, counting, stop_at=loop.time() + 0.1)
    assert 2 <= count <= 14  # ~0.1 s / 0.02 s per request x 2 workers, with slack


async def test_open_loop_sends_on_schedule() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent_at: list[float] = []

    async def send(spec: RequestSpec) -> None:
        sent_at.append(loop.time() - start)
        await asyncio.sleep(0.05)  # requests overlap: open loop does not wait for them

    offsets = [0.0, 0.02, 0.04, 0.06, 0.5]
    await run_open_loop(specs(5), offsets, send, stop_at=start + 0.3)
    assert len(sent_at) == 4  # the one due after the deadline is never sent
    for actual, due in zip(sent_at, offsets[:4], strict=True):
        assert due - 0.001 <= actual < due + 0.03


async def test_open_loop_max_concurrency() -> None:
    gauge = InFlight()

    async def send(spec: RequestSpec) -> None:
        gauge.enter()
        await asyncio.sleep(0.01)
        gauge.exit()

    loop = asyncio.get_running_loop()
    await run_open_loop(specs(20), [0.0] * 20, send, loop.time() + 10, max_concurrency=3)
    assert gauge.peak == 3


async def test_cancelling_a_driver_cancels_its_requests() -> None:
    cancelled = 0

    async def send(spec: RequestSpec) -> None:
        nonlocal cancelled
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled += 1
            raise

    loop = asyncio.get_running_loop()
    for driver in (
        run_closed_loop(specs(10), 3, send, loop.time() + 100),
        run_open_loop(specs(4), [0.0] * 4, send, loop.time() + 100),
    ):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(driver, timeout=0.05)
    assert cancelled == 3 + 4
