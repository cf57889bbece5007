"""Faults with the FakeEngine behind the real app: each one fails what it must and no more.

The real engine's per-request isolation (a row that raises inside a step) is tested in
tests/engine/test_faults.py and end to end in test_resilience_server.py; here the engine fails
as a whole, or the server fails on one request's output, or the loop dies.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from server.engine_client import AsyncEngineClient
from server.engine_types import EngineHealth, EngineUnavailableError
from server.generation import IncrementalDetokenizer
from tests.server.server_fakes import FakeEngine, tiny_tokenizer
from tests.server.test_streaming import split_frames

C = "/v1/completions"
MARKER = "STOP there END"  # text whose tokens mark a poisoned prompt below


def slow_engine(**kwargs: Any) -> FakeEngine:
    """A fake that takes 10 ms a step and has room for long requests."""
    return FakeEngine(
        **{"step_delay_s": 0.01, "max_model_len": 100_000, "num_blocks": 100_000, **kwargs}
    )


async def wait_until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def events(raw: bytes) -> list[Any]:
    """The JSON payloads of an SSE body, then "[DONE]"."""
    return [json.loads(f[6:]) if f[6:7] == b"{" else "[DONE]" for f in split_frames(raw)]


def assert_error(body: dict[str, Any], code: str, type_: str) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["code"], body["error"]["type"]) == (code, type_), body


async def test_a_failing_engine_step_fails_the_requests_in_flight_and_serving_goes_on(
    serve,
) -> None:
    """An exception from ``engine.step()`` itself (no request to blame: in the real engine,
    a scheduler failure) fails every request in flight with a 500; the pool stays
    consistent, so the loop serves the next request."""
    engine = FakeEngine(step_delay_s=0.01)
    s = await serve(engine)

    def fail_once_both_run(e: FakeEngine) -> None:
        if len(e.running) == 2:
            e.fail_next_step, e.before_step = RuntimeError("scheduler bug"), None

    engine.before_step = fail_once_both_run
    body = {"prompt": "hello", "max_tokens": 50, "temperature": 0}
    plain, streamed = await asyncio.gather(
        s.http.post(C, json=body), s.http.post(C, json={**body, "stream": True})
    )
    assert plain.status_code == 500
    assert_error(plain.json(), "engine_error", "server_error")
    assert "scheduler bug" in plain.json()["error"]["message"]
    error_event = events(streamed.content)[-2]
    assert_error(error_event, "engine_error", "server_error")
    await s.wait_idle()
    ok = await s.http.post(C, json={"prompt": "hello", "max_tokens": 3})
    assert ok.status_code == 200 and s.client.health().healthy


async def test_an_output_processing_failure_fails_only_its_request(serve, monkeypatch) -> None:
    """The detokenizer raising on one request's tokens: that request gets a 500 (or an
    in-band error event), its engine request is aborted, concurrent ones are untouched."""
    poison = tiny_tokenizer().encode(MARKER)

    class Fragile(IncrementalDetokenizer):
        def __init__(self, tokenizer: Any, prompt_ids: list[int], *options: Any) -> None:
            super().__init__(tokenizer, prompt_ids, *options)
            self.poisoned = poison[0] in prompt_ids

        def add(self, token_ids: list[int]) -> str:
            if self.poisoned:
                raise UnicodeError("broken bytes")
            return super().add(token_ids)

    monkeypatch.setattr("server.generation.IncrementalDetokenizer", Fragile)
    s = await serve(FakeEngine(step_delay_s=0.005))
    bad = {"prompt": MARKER, "max_tokens": 30, "temperature": 0}
    good = {"prompt": "hello", "max_tokens": 12, "temperature": 0}
    r_bad, r_bad_stream, r_good, r_good_stream = await asyncio.gather(
        s.http.post(C, json=bad),
        s.http.post(C, json={**bad, "stream": True}),
        s.http.post(C, json=good),
        s.http.post(C, json={**good, "stream": True}),
    )
    assert r_bad.status_code == 500
    assert_error(r_bad.json(), "output_processing_error", "server_error")
    assert "UnicodeError" in r_bad.json()["error"]["message"]
    assert_error(events(r_bad_stream.content)[-2], "output_processing_error", "server_error")
    expected = (await s.http.post(C, json=good)).json()["choices"][0]["text"]
    assert r_good.json()["choices"][0]["text"] == expected
    streamed = [e["choices"][0]["text"] for e in events(r_good_stream.content)[:-1]]
    assert "".join(streamed) == expected
    await s.wait_idle()  # the poisoned engine requests were aborted: blocks back


async def test_a_dead_engine_loop_turns_health_503_within_a_second(serve) -> None:
    """The loop itself crashing (not a step): /health is 503 within a second, requests in
    flight get an error, and new ones get a 503 at once instead of hanging."""
    engine = slow_engine()
    s = await serve(engine)
    stream_task = asyncio.create_task(
        s.http.post(C, json={"prompt": "hi", "max_tokens": 500, "stream": True})
    )
    await wait_until(lambda: s.client.snapshot.num_requests == 1)

    def crash() -> bool:
        raise MemoryError("the loop itself failed")

    engine.has_unfinished_requests = crash  # type: ignore[method-assign]
    start = time.monotonic()
    while (await s.http.get("/health")).status_code == 200:
        assert time.monotonic() - start < 1.0, "/health still 200 a second after the crash"
        await asyncio.sleep(0.01)
    health = (await s.http.get("/health")).json()
    assert health["status"] == "unhealthy" and "MemoryError" in health["reason"]
    streamed = await asyncio.wait_for(stream_task, 2)
    assert_error(events(streamed.content)[-2], "engine_error", "server_error")
    start = time.monotonic()
    r = await s.http.post(C, json={"prompt": "hi", "max_tokens": 2})
    assert time.monotonic() - start < 1.0
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert_error(r.json(), "engine_unavailable", "service_unavailable_error")


async def test_an_add_racing_the_loop_death_fails_instead_of_waiting_forever() -> None:
    """The loop dies between add()'s health check and its enqueue: the add must fail (a
    503), not wait for an acknowledgement nobody will send."""
    client = AsyncEngineClient(FakeEngine(), idle_wake_s=0.05)
    client.start()
    engine = client._engine_loop.engine
    assert isinstance(engine, FakeEngine)

    def crash() -> bool:
        raise MemoryError("gone")

    engine.has_unfinished_requests = crash  # type: ignore[method-assign]
    client.abort(["wake-up"])  # an idle loop checks for work only after taking intake
    await wait_until(lambda: not client.health().healthy)
    # Pretend the health check ran just before the crash.
    client.health = lambda: EngineHealth(True, None, 0.0, client.snapshot)  # type: ignore[method-assign]
    from scheduler.request import SamplingParams
    from server.engine_types import EngineRequest

    request = EngineRequest("late", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(EngineUnavailableError, match="MemoryError"):
        await asyncio.wait_for(client.add([request]), 1.0)
    assert client.num_unfinished == 0
    await client.shutdown()


# ------------------------------------------------------------------------------ timeouts


async def test_an_expired_request_is_aborted_and_answered_504(serve) -> None:
    s = await serve(slow_engine())
    body = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True}
    start = time.monotonic()
    r = await s.http.post(C, json=body, headers={"X-Request-Timeout": "0.2"})
    assert 0.2 <= time.monotonic() - start < 1.0
    assert r.status_code == 504
    assert_error(r.json(), "request_timeout", "timeout_error")
    assert "0.2 s" in r.json()["error"]["message"]
    await s.wait_idle()  # aborted in the engine: its blocks are back
    streamed = await s.http.post(
        C, json={**body, "stream": True}, headers={"X-Request-Timeout": "0.2"}
    )
    chunks = events(streamed.content)
    assert chunks[-1] == "[DONE]" and len(chunks) > 3  # some tokens, then the error
    assert_error(chunks[-2], "request_timeout", "timeout_error")
    await s.wait_idle()


async def test_the_server_timeout_caps_the_header_and_covers_queueing(serve) -> None:
    """--request-timeout is an upper bound a header cannot raise; the deadline counts from
    arrival, so a request stuck behind others in the queue expires too."""
    engine = slow_engine(max_num_seqs=1)
    s = await serve(engine, request_timeout_s=0.3)
    start = time.monotonic()
    long = asyncio.create_task(
        s.http.post(
            C,
            json={"prompt": "a", "max_tokens": 200, "ignore_eos": True},
            headers={"X-Request-Timeout": "9"},
        )
    )
    await wait_until(lambda: s.client.num_unfinished == 1)
    queued = await s.http.post(C, json={"prompt": "b", "max_tokens": 200, "ignore_eos": True})
    assert queued.status_code == 504  # it waited behind the long one most of its time
    assert "0.3 s" in queued.json()["error"]["message"]
    r = await long
    assert r.status_code == 504 and time.monotonic() - start < 1.0  # 200 steps take 2 s
    await s.wait_idle()
    assert sorted(engine.aborted) == sorted(engine.added)  # both aborted, blocks back


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan", ""])
async def test_a_bad_timeout_header_is_400(serve, value: str) -> None:
    s = await serve()
    r = await s.http.post(
        C, json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Timeout": value}
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "X-Request-Timeout"


async def test_a_deadline_that_does_not_pass_changes_nothing(serve) -> None:
    s = await serve(request_timeout_s=30)
    r = await s.http.post(
        C,
        json={"prompt": "hi", "max_tokens": 5, "temperature": 0},
        headers={"X-Request-Timeout": "10"},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


# ------------------------------------------------------------------------------ backpressure


async def hold(s: Any, num: int, **body: Any) -> list[asyncio.Task]:
    """Start ``num`` long streaming requests and wait until the server holds them all."""
    payload = {"prompt": "hello", "max_tokens": 10_000, "ignore_eos": True, "stream": True}
    tasks = [asyncio.create_task(s.http.post(C, json={**payload, **body})) for _ in range(num)]
    await wait_until(lambda: s.client.num_unfinished == num)
    return tasks


async def release(s: Any, tasks: list[asyncio.Task]) -> None:
    s.client.abort(list(s.client._streams))
    await asyncio.gather(*tasks)
    await s.wait_idle()


async def test_a_full_queue_answers_503_with_retry_after_before_tokenizing(
    serve, monkeypatch
) -> None:
    from scheduler.config import SchedulerConfig

    engine = slow_engine(max_num_seqs=2)
    s = await serve(engine, SchedulerConfig(max_num_seqs=2), max_waiting_requests=2)
    tasks = await hold(s, 4)  # 2 running + 2 waiting: full
    tokenized = []
    real = tiny_tokenizer().encode
    monkeypatch.setattr(
        s.client.tokenizer, "encode", lambda *a, **k: tokenized.append(a) or real(*a, **k)
    )
    r = await s.http.post(C, json={"prompt": "one more", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert_error(r.json(), "server_overloaded", "service_unavailable_error")
    chat = await s.http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat.status_code == 503
    assert tokenized == []  # refused before any tokenization or templating
    health = (await s.http.get("/health")).json()
    assert health["requests"] == {"in_flight": 4, "capacity": 4}
    await release(s, tasks)
    ok = await s.http.post(C, json={"prompt": "one more", "max_tokens": 2})
    assert ok.status_code == 200


async def test_choices_count_against_the_queue_and_an_unservable_n_is_400(serve) -> None:
    from scheduler.config import SchedulerConfig

    # The fake runs everything at once; the server believes in 2 running + 3 waiting.
    s = await serve(slow_engine(), SchedulerConfig(max_num_seqs=2), max_waiting_requests=3)
    too_many = await s.http.post(C, json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "too_many_sequences"
    tasks = await hold(s, 2)
    r = await s.http.post(C, json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1})  # 4 > 3 left
    assert r.status_code == 503
    r = await s.http.post(C, json={"prompt": [[5, 6], [7, 8, 9]], "n": 1, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    await release(s, tasks)


async def test_a_memory_bound_batch_keeps_the_waiting_bound(serve) -> None:
    """When KV blocks, not max_num_seqs, limit the batch, fewer requests run and the
    waiting bound still holds: here one request fits the pool, so with
    max_waiting_requests=2 the fourth is refused although max_num_seqs is 8."""
    from scheduler.config import SchedulerConfig

    engine = FakeEngine(step_delay_s=0.01, max_num_seqs=8, num_blocks=5, block_size=4)
    s = await serve(engine, SchedulerConfig(max_num_seqs=8), max_waiting_requests=2)
    prompt = "one two three four five six seven eight nine ten"  # 3+ blocks: one at a time
    tasks = await hold(s, 3, prompt=prompt, max_tokens=30)
    await wait_until(lambda: getattr(s.client.snapshot.last_step_stats, "num_waiting", 0) == 2)
    stats = s.client.snapshot.last_step_stats
    assert (stats.num_running, stats.num_waiting) == (1, 2)
    r = await s.http.post(C, json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
    await release(s, tasks)


# ------------------------------------------------------------------------------ limits


async def test_prompt_and_output_token_limits(serve) -> None:
    s = await serve(max_prompt_tokens=8, max_output_tokens=4)
    long = await s.http.post(C, json={"prompt": list(range(3, 12)), "max_tokens": 2})
    assert long.status_code == 400
    assert (long.json()["error"]["code"], long.json()["error"]["param"]) == (
        "prompt_too_long",
        "prompt",
    )
    chat = await s.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "one two three four five six"}]},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    over = await s.http.post(C, json={"prompt": "hi", "max_tokens": 5})
    assert over.status_code == 400
    assert (over.json()["error"]["code"], over.json()["error"]["param"]) == (
        "max_tokens_exceeded",
        "max_tokens",
    )
    capped = await s.http.post(C, json={"prompt": "hi", "max_tokens": None, "ignore_eos": True})
    assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] == 4


async def test_health_reports_the_idle_integrity_check(serve) -> None:
    s = await serve()
    await s.http.post(C, json={"prompt": "hi", "max_tokens": 3})
    await s.wait_idle()
    for _ in range(100):
        engine = (await s.http.get("/health")).json()["engine"]
        if engine["integrity_checked_at_step"] == engine["num_steps"] > 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no idle integrity check after the last step: {engine}")


async def test_a_broken_pool_invariant_is_fatal(serve) -> None:
    """check_integrity() failing (after each step under --check-integrity, as here; its
    constant-time part, check_idle(), always runs when the engine goes idle) means the pool
    is corrupt, a leak or a double owner: serving
    on would hand out wrong blocks, so the loop stops and /health turns 503 for the
    orchestrator to restart the process."""
    engine = FakeEngine()
    s = await serve(engine)

    def leaked() -> None:
        raise AssertionError("3 blocks owned by nobody")

    engine.check_integrity = leaked  # type: ignore[method-assign]
    await s.http.post(C, json={"prompt": "hi", "max_tokens": 2})
    await wait_until(lambda: not s.client.health().healthy)
    health = await s.http.get("/health")
    assert health.status_code == 503 and "3 blocks owned by nobody" in health.json()["reason"]
