"""Draining: new requests 503 while in-flight ones finish; past the drain timeout they are cut
off with a 503. The SIGTERM -> exit 0 path of the real process is in test_resilience_server.py."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import uvicorn

from loadtest.launcher import free_port
from server.api import create_app
from server.config import ServerConfig, ServingConfig
from server.engine_client import AsyncEngineClient
from server.shutdown import make_server
from tests.server.server_fakes import FakeEngine

C = "/v1/completions"


async def test_draining_refuses_new_requests_and_lets_in_flight_ones_finish(serve) -> None:
    engine = FakeEngine(step_delay_s=0.01, max_model_len=10_000, num_blocks=10_000)
    s = await serve(engine)
    drain = s.app.state.drain
    body = {"prompt": "hi", "max_tokens": 40, "ignore_eos": True}
    in_flight = [
        asyncio.create_task(s.http.post(C, json=body)),
        asyncio.create_task(s.http.post(C, json={**body, "stream": True})),
    ]
    while drain.num_in_flight < 2:
        await asyncio.sleep(0.01)
    drain.draining = True
    refused = await s.http.post(C, json=body)
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert (await s.http.get("/v1/models")).status_code == 503
    health = await s.http.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert (await s.http.get("/metrics")).status_code == 200  # still scraped while draining
    plain, streamed = await asyncio.gather(*in_flight)
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 40
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert await drain.wait_idle(1.0)


def test_the_drain_timeout_cuts_off_what_still_runs_and_stops_the_server() -> None:
    """A signal starts the drain; after --drain-timeout the engine stops, a non-streaming
    request still running gets a 503 and a stream an in-band error, and uvicorn exits."""
    engine = FakeEngine(step_delay_s=0.01, max_model_len=100_000, num_blocks=100_000)
    client = AsyncEngineClient(engine, idle_wake_s=0.05)
    app = create_app(ServingConfig(server=ServerConfig(stats_log_interval_s=0)), client)
    port = free_port()
    config = uvicorn.Config(app, port=port, log_level="warning", timeout_graceful_shutdown=5)
    server = make_server(config, app.state.drain, client, drain_timeout_s=0.5)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # not main
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}{C}"
    body = {"prompt": "hi", "max_tokens": 5000, "ignore_eos": True}

    async def run() -> tuple[httpx.Response, list[str]]:
        async with httpx.AsyncClient(timeout=30) as http:
            plain = asyncio.create_task(http.post(url, json=body))
            async with http.stream("POST", url, json={**body, "stream": True}) as r:
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    if len(lines) == 4:  # streaming: now signal, as SIGTERM would
                        server.handle_exit(signal.SIGTERM, None)
            return await plain, lines

    start = time.monotonic()
    plain, lines = asyncio.run(run())
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - start < 5
    assert plain.status_code == 503
    assert plain.json()["error"]["code"] == "server_shutting_down"
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "server_shutting_down"
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
