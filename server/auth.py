"""Optional API-key authentication and CORS.

Keys (``--api-key``, ``PAGEDSERVE_API_KEY``; several allowed) are checked by plain ASGI
middleware before the body is read, so an unauthenticated client cannot make the server
parse, tokenize or even buffer its request. Every path needs a key except the
``--public-paths`` (``/health`` and ``/metrics`` by default): new routes are protected unless
listed, never the other way round. Clients send ``Authorization: Bearer <key>``, as the
openai SDK does.

Constant time: the presented key and every configured key are hashed with SHA-256 and the
digests compared with ``hmac.compare_digest``, against *all* keys without stopping at the
first match, so neither the length of a key nor which key matched shows in the timing. The
401 body never echoes what was sent.

CORS is off unless ``--cors-origins`` lists origins: a browser page on another origin then
may call the API (with a key, when keys are set). CORS sits outside authentication so that
preflight ``OPTIONS`` requests, which carry no credentials, get their answer.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import AUTHENTICATION, error_body


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def bearer_token(scope: Scope) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, if any."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return bytes(token.strip())
            return None
    return None


class APIKeyMiddleware:
    """401 for any request outside ``public_paths`` without one of ``api_keys``."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str], public_paths: Sequence[str]) -> None:
        self.app = app
        self._digests = [_digest(key.encode()) for key in api_keys]
        self._public = frozenset(public_paths)

    def is_valid(self, token: bytes | None) -> bool:
        presented = _digest(token if token is not None else b"")
        valid = False
        for digest in self._digests:
            # `|` rather than `or`: compare with every key, whatever matched before.
            valid |= hmac.compare_digest(presented, digest)
        return valid and token is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._public:
            await self.app(scope, receive, send)
            return
        if self.is_valid(bearer_token(scope)):
            await self.app(scope, receive, send)
            return
        body = error_body(
            "Missing or invalid API key: send it as 'Authorization: Bearer <key>'.",
            type=AUTHENTICATION,
            code="invalid_api_key",
        )
        payload = json.dumps(body).encode()
        headers: list[Any] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def add_cors(app: FastAPI, origins: Sequence[str]) -> None:
    """Allow the listed origins (``*`` for any); without origins, add nothing."""
    if not origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(origins),
        allow_methods=["GET", "POST"],
        allow_headers=["Authorization", "Content-Type", "X-Request-Timeout"],
        # Keys travel in a header, not a cookie: no credentialed requests.
        allow_credentials=False,
        max_age=600,
    )
