"""AsyncEngineClient: the engine thread, intake, delivery, failures, health and idling."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from scheduler.request import SamplingParams
from server.engine_client import AsyncEngineClient
from server.engine_types import EngineRequest, EngineUnavailableError
from tests.server.server_fakes import FakeEngine, tiny_tokenizer

GREEDY = SamplingParams(max_tokens=5, temperature=0)


def requests(*ids: str, params: SamplingParams = GREEDY) -> list[EngineRequest]:
    return [EngineRequest(i, tiny_tokenizer().encode("hello"), params) for i in ids]


async def drain(stream) -> list:
    outputs = []
    while batch := await stream.get():
        outputs.extend(batch)
    return outputs


@pytest.fixture
async def client():
    engine = FakeEngine()
    c = AsyncEngineClient(engine, idle_wake_s=0.05, check_integrity=True)
    c.start()
    yield c
    await c.shutdown()


async def test_outputs_are_routed_per_stream(client: AsyncEngineClient) -> None:
    a = await client.add(requests("a-0", "a-1"))
    b = await client.add(requests("b-0", params=SamplingParams(max_tokens=3, temperature=0)))
    out_a, out_b = await asyncio.gather(drain(a), drain(b))
    assert {o.request_id for o in out_a} == {"a-0", "a-1"}
    assert [o.request_id for o in out_b] == ["b-0"] * 3
    assert sum(len(o.new_token_ids) for o in out_a) == 10
    assert out_b[-1].finished and out_b[-1].finish_reason == "length"
    assert a.finished and b.finished


async def test_only_the_engine_thread_touches_the_engine(client: AsyncEngineClient) -> None:
    await drain(await client.add(requests("x")))
    engine = client._engine_loop.engine
    assert isinstance(engine, FakeEngine)
    assert engine._owner is not None and engine._owner != threading.get_ident()


async def test_refused_request_raises_and_leaves_nothing_behind(client) -> None:
    too_long = SamplingParams(max_tokens=10_000)
    with pytest.raises(ValueError, match="max_model_len"):
        await client.add(requests("ok-0", "bad-1", params=too_long))
    assert client._streams == {}
    await asyncio.sleep(0.1)
    assert client.snapshot.num_requests == 0


async def test_duplicate_ids_are_refused(client: AsyncEngineClient) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        await client.add(requests("d", "d"))


async def test_abort_finishes_with_abort_and_frees_blocks(client: AsyncEngineClient) -> None:
    engine = client._engine_loop.engine
    assert isinstance(engine, FakeEngine)
    engine.step_delay_s = 0.01
    stream = await client.add(requests("long", params=SamplingParams(max_tokens=200)))
    first = await stream.get()
    assert first and not first[-1].finished
    client.abort(["long"])
    rest = await drain(stream)
    assert rest[-1].finish_reason == "abort"
    await asyncio.sleep(0.1)
    snap = client.snapshot
    assert snap.num_requests == 0 and snap.num_free_blocks == snap.num_total_blocks


async def test_step_failure_fails_requests_in_flight_and_keeps_serving(client) -> None:
    engine = client._engine_loop.engine
    assert isinstance(engine, FakeEngine)
    engine.step_delay_s = 0.005
    stream = await client.add(requests("victim", params=SamplingParams(max_tokens=100)))
    await stream.get()
    engine.fail_next_step = RuntimeError("boom in the sampler")
    outputs = await drain(stream)
    assert outputs[-1].finish_reason == "error"
    assert "boom in the sampler" in (outputs[-1].error or "")
    assert engine.num_free_blocks == engine.num_total_blocks  # aborted, blocks returned
    assert client.health().healthy
    after = await drain(await client.add(requests("after")))
    assert after[-1].finish_reason == "length"


async def test_engine_that_cannot_recover_is_reported_dead() -> None:
    engine = FakeEngine(step_delay_s=0.005)
    c = AsyncEngineClient(engine, idle_wake_s=0.05)
    c.start()
    try:
        stream = await c.add(requests("r", params=SamplingParams(max_tokens=100)))
        await stream.get()

        def broken_abort(ids):  # the engine's state is corrupt: even abort fails
            raise RuntimeError("corrupt state")

        engine.abort_request = broken_abort  # type: ignore[method-assign]
        engine.fail_next_step = RuntimeError("boom")
        outputs = await drain(stream)
        assert outputs[-1].finish_reason == "error"
        assert "corrupt state" in (outputs[-1].error or "")
        await asyncio.sleep(0.05)
        health = c.health()
        assert not health.healthy and "died" in (health.reason or "")
        with pytest.raises(EngineUnavailableError):
            await c.add(requests("new"))
    finally:
        await c.shutdown()


async def test_going_idle_runs_the_constant_time_check_and_a_failure_is_fatal() -> None:
    """Without --check-integrity the loop never walks the whole pool: each time the engine
    goes idle it runs check_idle(), whose failure (a leaked block) stops serving."""
    engine = FakeEngine()
    idle_checks: list[int] = []

    def whole_check() -> None:
        raise AssertionError("check_integrity walked the pool without --check-integrity")

    def idle_check() -> None:
        idle_checks.append(len(idle_checks))
        if len(idle_checks) == 2:
            raise AssertionError("2 blocks leaked")

    engine.check_integrity = whole_check  # type: ignore[method-assign]
    engine.check_idle = idle_check  # type: ignore[method-assign]
    c = AsyncEngineClient(engine, idle_wake_s=0.05)
    c.start()
    try:
        await drain(await c.add(requests("first")))
        for _ in range(100):
            if c.snapshot.integrity_checked_at_step == c.snapshot.num_steps:
                break
            await asyncio.sleep(0.01)
        assert idle_checks == [0] and c.health().healthy
        await drain(await c.add(requests("second")))
        for _ in range(100):
            if not c.health().healthy:
                break
            await asyncio.sleep(0.01)
        health = c.health()
        assert not health.healthy and "2 blocks leaked" in (health.reason or ""), health
    finally:
        await c.shutdown()


async def test_stalled_step_makes_health_fail_then_recover() -> None:
    engine = FakeEngine()
    release = threading.Event()
    engine.before_step = lambda e: release.wait(5)
    c = AsyncEngineClient(engine, idle_wake_s=0.02, stall_timeout_s=0.2)
    c.start()
    try:
        stream = await c.add(requests("s"))
        await asyncio.sleep(0.4)
        health = c.health()
        assert not health.healthy and "stalled" in (health.reason or "")
        engine.before_step = None
        release.set()
        await drain(stream)
        assert c.health().healthy
    finally:
        release.set()
        await c.shutdown()


async def test_idle_engine_thread_does_not_spin(client: AsyncEngineClient) -> None:
    await drain(await client.add(requests("warm")))
    await asyncio.sleep(0.1)
    cpu_before, wall_before = time.process_time(), time.monotonic()
    beat_before = client._engine_loop.heartbeat
    await asyncio.sleep(0.5)
    cpu = time.process_time() - cpu_before
    assert cpu < 0.15 * (time.monotonic() - wall_before), f"idle loop used {cpu:.3f}s CPU"
    assert client._engine_loop.heartbeat > beat_before, (
        "the idle loop must still refresh its heartbeat"
    )
    assert client.health().healthy


async def test_shutdown_ends_open_streams_with_an_error() -> None:
    engine = FakeEngine(step_delay_s=0.01)
    c = AsyncEngineClient(engine, idle_wake_s=0.05)
    c.start()
    stream = await c.add(requests("open", params=SamplingParams(max_tokens=200)))
    await stream.get()
    await c.shutdown()
    outputs = await drain(stream)
    assert outputs[-1].finish_reason == "error"
    assert not c.health().healthy


async def test_step_stats_reach_the_metrics_hook(client: AsyncEngineClient) -> None:
    seen = []
    client.on_step = seen.append
    await drain(await client.add(requests("m")))
    await asyncio.sleep(0.05)
    assert len(seen) >= 5 and all(s.num_kv_blocks_total == 64 for s in seen)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
async def test_each_computed_step_reaches_the_metrics_hook_once(
    tmp_path_factory: pytest.TempPathFactory, async_scheduling: bool
) -> None:
    """A real engine: every step it computes reaches ``on_step`` once. With asynchronous
    scheduling each request's last ``step()`` call only reads the step in flight and
    computes none; its figures were the step before's, and counted twice (step counts,
    tokens, FLOPs and bytes in /metrics) until the loop learned to tell. The requests that
    call finishes still count for the queue-time estimate (``DrainRate``)."""
    from engine import LLM
    from tests.engine.conftest import make_tiny_llama

    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-steps"), num_kv_heads=2)
    llm = LLM(
        str(model), device="cpu", dtype="float32", block_size=4, num_kv_blocks=32,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    c = AsyncEngineClient(llm.engine, idle_wake_s=0.05)
    seen = []
    c.on_step = seen.append
    finishes: list[int] = []
    on_step = c.drain_rate.on_step
    c.drain_rate.on_step = lambda now, n: (finishes.append(n), on_step(now, n))  # type: ignore[method-assign]
    c.start()
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        for i in range(3):  # one at a time: the engine goes idle after each
            await drain(await c.add([EngineRequest(f"r{i}", [5 + i, 6, 7, 8, 9], params)]))
        await asyncio.sleep(0.1)
    finally:
        await c.shutdown()
    # Each request: its prompt's step, then three decodes.
    assert len(seen) == 12
    assert len({id(s) for s in seen}) == 12
    assert sum(s.num_decode_tokens for s in seen) == 9
    assert sum(finishes) == 3  # the queue-time estimate counts every finish
