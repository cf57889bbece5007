"""The request-body size limit, enforced before any parsing (413).

Other limits: the waiting queue is server/admission.py, per-request token and ``n`` limits
are server/sampling.py, deadlines server/timeouts.py.

``BodySizeLimitMiddleware`` is plain ASGI so it sees the body before FastAPI reads it: a
``Content-Length`` above the limit is answered 413 at once, and a chunked body is counted as
it arrives and cut off with a 413 as soon as it passes the limit. Bodies under the limit are
replayed to the app unchanged; later ``receive()`` calls (disconnect detection) go straight
to the server.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import INVALID_REQUEST, error_body


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._reject(send, declared)
            return
        # Read the whole body (bounded) before the app runs, then replay it.
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # a disconnect: let the app see it
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                await self._reject(send, size)
                return
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def replay_receive() -> Message:
            message = next(replay, None)
            return message if message is not None else await receive()

        await self.app(scope, replay_receive, send)

    async def _reject(self, send: Send, size: int) -> None:
        body = error_body(
            f"Request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes "
            "(--max-body-size).",
            type=INVALID_REQUEST,
            code="request_too_large",
        )
        payload = json.dumps(body).encode()
        headers: list[Any] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
