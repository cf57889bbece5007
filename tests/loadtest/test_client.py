"""The streaming client against the fake server, through real sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from loadtest.client import ClientOptions, CompletionClient, RequestRecord
from loadtest.workloads import RequestSpec
from tests.loadtest.fake_server import MODEL_ID, FakeServer


def spec(max_tokens: int = 8, **kw: object) -> RequestSpec:
    return RequestSpec(index=0, prompt="a b c d", prompt_len=4, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


async def send(
    server: FakeServer, s: RequestSpec, repeat: int = 1, **options: object
) -> RequestRecord:
    """Send ``s`` ``repeat`` times over one connection pool; return the last record."""
    opts = ClientOptions(base_url=server.base_url, model=MODEL_ID, **options)  # type: ignore[arg-type]
    async with CompletionClient(opts) as client:
        for _ in range(repeat):
            record = RequestRecord.for_spec(s)
            await client.stream_completion(s, record, time.perf_counter())
    return record


async def test_streams_and_timestamps(fake_server: Callable[..., FakeServer]) -> None:
    server = fake_server(step_s=0.005)
    # The second request reuses the kept-alive connection (where Nagle delays used to show).
    r = await send(server, spec(8), repeat=2)
    assert r.ok and r.status_code == 200 and r.finish_reason == "length"
    assert r.output_tokens == 8 and r.output_tokens_source == "usage" and r.prompt_tokens == 4
    # One timestamp per token chunk; the finish-only and usage-only chunks are not tokens.
    assert len(r.chunk_times_s) == 8
    assert r.chunk_times_s == sorted(r.chunk_times_s)
    assert r.ttft_s == r.chunk_times_s[0] and r.e2e_s is not None
    assert r.e2e_s >= r.chunk_times_s[-1]
    # Tokens come one per 5 ms step and are timestamped as they arrive, not in bursts (a
    # buffering client, or Nagle's algorithm on the socket, would give ~0 gaps here).
    assert r.chunk_times_s[-1] - r.chunk_times_s[0] >= 7 * 0.004
    gaps = sorted(b - a for a, b in zip(r.chunk_times_s[:-1], r.chunk_times_s[1:], strict=True))
    assert gaps[len(gaps) // 2] >= 0.002
    body = server.state.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 8 and body["model"] == MODEL_ID
    assert server.state.num_disconnects == 0  # the stream was read to its end


async def test_without_ignore_eos(fake_server: Callable[..., FakeServer]) -> None:
    server = fake_server()
    r = await send(server, spec(8), ignore_eos=False, extra_body={"top_k": 5})
    assert "ignore_eos" not in server.state.bodies[0]
    assert server.state.bodies[0]["top_k"] == 5
    assert r.ok and r.output_tokens == 3 and r.finish_reason == "stop"  # the fake's "EOS"


async def test_http_error_is_recorded_not_raised(fake_server: Callable[..., FakeServer]) -> None:
    server = fake_server(fail_every=1)
    r = await send(server, spec(4))
    assert not r.ok and r.status_code == 400
    assert r.error is not None and "injected failure" in r.error
    assert r.output_tokens == 0 and r.ttft_s is None


async def test_connection_refused_is_recorded() -> None:
    server_url = "http://127.0.0.1:9"  # discard port: nothing listens there
    record = RequestRecord.for_spec(spec())
    async with CompletionClient(ClientOptions(base_url=server_url, model="m")) as client:
        await client.stream_completion(spec(), record, time.perf_counter())
    assert record.error is not None and record.status_code is None and not record.ok


async def test_planned_cancel_disconnects(fake_server: Callable[..., FakeServer]) -> None:
    server = fake_server(step_s=0.01)
    r = await send(server, spec(50, cancel_after_chunks=3))
    assert r.cancelled and r.cancel_reason == "client" and r.error is None
    assert 3 <= len(r.chunk_times_s) < 50 and r.output_tokens == len(r.chunk_times_s)
    deadline = time.monotonic() + 2.0
    while server.state.num_disconnects == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # the server notices the hang-up on its next write
    assert server.state.num_disconnects == 1
