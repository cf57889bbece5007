"""Graceful shutdown: on SIGTERM, drain in-flight requests, then exit 0.

::

    SIGTERM ─> draining: new requests get 503 (server_shutting_down, Connection: close),
               /health answers 503 "draining" so a load balancer stops sending traffic;
               the listening socket stays open, so clients get that 503, not a refused
               connection
            ─> in-flight requests run to completion, for up to --drain-timeout seconds
            ─> past that, the engine stops and what still runs ends with a 503 (or, on a
               stream that already started, an in-band error event)
            ─> uvicorn closes the sockets, the app's lifespan stops the engine thread,
               the process exits 0

A second SIGTERM or SIGINT ends the drain at once (a third SIGINT exits without waiting for
connections). uvicorn's own handler would re-raise the signal after its shutdown, which makes
the exit status "killed by SIGTERM" rather than 0; ``DrainingServer`` does not, because a
drained shutdown is a success.

``DrainMiddleware`` is plain ASGI, outside everything but CORS: it counts the requests in
flight (all paths except ``/health`` and ``/metrics``, which report state and must keep
answering during the drain) and turns new ones away once draining began.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Receive, Scope, Send

from server.connections import (
    AcceptErrorLog,
    ConnectionLimits,
    bounded_protocol,
    default_max_connections,
    raise_fd_limit,
)
from server.errors import server_shutting_down

if TYPE_CHECKING:
    import uvicorn

    from server.engine_client import AsyncEngineClient

logger = logging.getLogger(__name__)

# Paths that keep answering while draining and are not waited for.
STATUS_PATHS = frozenset({"/health", "/metrics"})


class DrainState:
    """Whether the server is draining, and how many requests it still serves (event loop)."""

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True


class DrainMiddleware:
    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in STATUS_PATHS:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            error = server_shutting_down()
            payload = json.dumps(error.body()).encode()
            headers: list[Any] = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ]
            headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": payload})
            return
        self.state.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_in_flight -= 1


def make_server(
    config: uvicorn.Config, state: DrainState, client: AsyncEngineClient, drain_timeout_s: float
) -> uvicorn.Server:
    """A uvicorn server that drains on SIGTERM/SIGINT and then exits normally."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self) -> None:
            super().__init__(config)
            self._loop: asyncio.AbstractEventLoop | None = None
            self._drain_task: asyncio.Task[None] | None = None
            self._num_signals = 0

        async def startup(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            AcceptErrorLog().install(self._loop)
            await super().startup(sockets=sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Runs in the main thread between bytecodes of the event loop: only schedule.
            self._num_signals += 1
            if self._loop is None:  # not serving yet: nothing to drain
                self.should_exit = True
            elif self._num_signals == 1:
                self._loop.call_soon_threadsafe(self._begin_drain, signal.Signals(sig).name)
            else:
                logger.warning("second signal: ending the drain now")
                self.should_exit = True
                if sig == signal.SIGINT and self._num_signals > 2:
                    self.force_exit = True

        def _begin_drain(self, name: str) -> None:
            self._drain_task = asyncio.ensure_future(self._drain(name))

        async def _drain(self, name: str) -> None:
            state.draining = True
            logger.info(
                "%s: draining %d in-flight request(s) for up to %g s; new requests get 503",
                name,
                state.num_in_flight,
                drain_timeout_s,
            )
            if await state.wait_idle(drain_timeout_s):
                logger.info("drained: no request in flight")
            else:
                logger.warning(
                    "drain timeout: stopping the engine under %d request(s)", state.num_in_flight
                )
                await client.shutdown()  # their streams end with a 503 / in-band error
                await state.wait_idle(5.0)  # let the handlers send those errors
            self.should_exit = True

    return DrainingServer()


def serve_until_drained(
    app: Any, *, host: str, port: int, log_level: str, drain_timeout_s: float
) -> None:
    """Run uvicorn on ``app`` (built by ``create_app``) until a signal drains it, with the
    connection bounds of its config (server/connections.py)."""
    import uvicorn

    server_config = app.state.ctx.config.server
    fd_limit = raise_fd_limit()
    max_connections = server_config.max_connections or default_max_connections(fd_limit)
    logger.info(
        "open-file limit %d; at most %d connections, %g s to send a request, %g s a client may "
        "stop reading",
        fd_limit,
        max_connections,
        server_config.header_timeout_s,
        server_config.stream_send_timeout_s,
    )
    limits = ConnectionLimits(
        max_connections=max_connections,
        header_timeout_s=server_config.header_timeout_s,
        stream_send_timeout_s=server_config.stream_send_timeout_s,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=bounded_protocol(limits),
        # The stdlib loop whatever is installed: uvicorn's "auto" would pick uvloop when it is
        # present, which handles accept() failures inside libuv, where neither the loop's
        # exception handler (AcceptErrorLog) nor asyncio's ACCEPT_RETRY_DELAY applies, so
        # the fd-exhaustion behaviour tested in tests/server/test_connections.py would not hold.
        loop="asyncio",
        # After the drain, only idle or cut-off connections remain: close them quickly.
        timeout_graceful_shutdown=5,
    )
    make_server(config, app.state.drain, app.state.ctx.client, drain_timeout_s).run()
