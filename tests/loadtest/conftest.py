from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.loadtest.fake_server import FakeConfig, FakeServer


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    """Factory: ``fake_server(batching="static", ...)`` starts a FakeServer for this test."""
    servers: list[FakeServer] = []

    def start(**overrides: object) -> FakeServer:
        server = FakeServer(FakeConfig(**overrides))  # type: ignore[arg-type]
        servers.append(server.__enter__())
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)
