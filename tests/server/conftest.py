"""Fixtures for the server's fast tests: the app around a FakeEngine, driven through httpx's
ASGI transport (no sockets). The real-server tests live in test_integration.py."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from scheduler.config import SchedulerConfig
from server.api import create_app
from server.config import ServerConfig, ServingConfig
from server.engine_client import AsyncEngineClient
from tests.server.server_fakes import FakeEngine


@dataclasses.dataclass
class Served:
    """One app under test: its HTTP client, the engine client and the fake engine."""

    http: httpx.AsyncClient
    client: AsyncEngineClient
    engine: FakeEngine
    app: FastAPI

    async def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Wait until the engine thread has no request left (aborts processed)."""
        import asyncio
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            snap = self.client.snapshot
            if snap.num_requests == 0 and snap.num_free_blocks == snap.num_total_blocks:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"engine not idle after {timeout_s}s: {self.client.snapshot}")


ServeFactory = Callable[..., Any]


@pytest.fixture
async def serve() -> AsyncIterator[ServeFactory]:
    """``await serve(engine=None, scheduler=None, **server_config_overrides)`` -> ``Served``.

    ``scheduler`` matters to the server only through ``max_num_seqs`` (admission capacity).
    """
    opened: list[Served] = []

    async def factory(
        engine: FakeEngine | None = None, scheduler: SchedulerConfig | None = None, **server: Any
    ) -> Served:
        engine = engine or FakeEngine()
        config = ServingConfig(
            scheduler=scheduler or SchedulerConfig(),
            server=ServerConfig(stats_log_interval_s=0, **server),
        )
        client = AsyncEngineClient(
            engine,
            check_integrity=True,
            idle_wake_s=0.05,
            stall_timeout_s=config.server.engine_stall_timeout_s,
        )
        app = create_app(config, client)
        client.start()  # httpx's ASGI transport does not run the lifespan
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=10
        )
        served = Served(http, client, engine, app)
        opened.append(served)
        return served

    yield factory
    for served in opened:
        await served.http.aclose()
        await served.client.shutdown()
