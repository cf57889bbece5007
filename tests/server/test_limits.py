"""BodySizeLimitMiddleware: 413 on a declared or streamed body above the limit."""

from __future__ import annotations

from collections.abc import AsyncIterator


async def test_declared_length_above_limit_is_413(serve) -> None:
    s = await serve(max_body_bytes=1000)
    r = await s.http.post("/v1/completions", json={"prompt": "x" * 2000})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


async def test_chunked_body_above_limit_is_413(serve) -> None:
    s = await serve(max_body_bytes=1000)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    r = await s.http.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413


async def test_chunked_body_under_limit_is_replayed_intact(serve) -> None:
    s = await serve(max_body_bytes=1000)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": "hel'
        yield b'lo", "max_tokens": 2}'

    r = await s.http.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
