"""ASGI middleware that counts every HTTP response by route template and status code."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from server.metrics import ServerMetrics


class HTTPMetricsMiddleware:
    """Counts every HTTP response by route template and status code (plain ASGI).

    Install it outermost (added last) so it also sees the answers of the other middleware
    (413 body limit, 401, 429/503 admission). A request that fails before a response starts
    counts as 500 (what Starlette's error middleware answers), or 499 if it was cancelled
    because the client went away. Paths that match no route count as ``other``, so random
    URLs cannot grow the label set.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        except asyncio.CancelledError:
            status = status if status is not None else 499
            raise
        except Exception:
            status = status if status is not None else 500
            raise
        finally:
            self.metrics.record_http(_handler(scope), status if status is not None else 500)


def _handler(scope: Scope) -> str:
    route_path = getattr(scope.get("route"), "path", None)
    if isinstance(route_path, str):
        return route_path
    # Answered before routing (e.g. a 413 from the body-size limit): the raw path if it is
    # one of the app's routes.
    app = scope.get("app")
    paths = {getattr(r, "path", None) for r in getattr(app, "routes", ())}
    path = scope.get("path", "")
    return path if path in paths else "other"
