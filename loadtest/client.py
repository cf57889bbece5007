"""Async streaming client for ``POST /v1/completions`` that timestamps every streamed chunk.

Every request is sent with ``stream: true`` and ``stream_options: {"include_usage": true}``,
so the server's own token counts arrive in a final usage chunk; ``ignore_eos: true`` (unless
turned off for servers that reject it) and ``max_tokens`` fix the output length.

What is measured per request (all times from ``time.perf_counter()``):

- send time: just before the request is handed to httpx;
- each *content chunk*'s arrival: an SSE event carrying at least one choice that either has
  text or is not the terminal "finish_reason only" chunk (usage-only chunks have no choices);
- TTFT = first content chunk - send; E2E = end of stream (``[DONE]``) - send;
- output tokens: ``usage.completion_tokens`` when the server sends usage, otherwise the
  number of content chunks (one token per chunk, which is what servers send without usage).

Errors (non-200 status with its body, an ``{"error": ...}`` event mid-stream, a broken
connection, bad JSON, a stream that ends without ``[DONE]`` or a finish reason) are recorded,
never raised: one failing request must not stop a benchmark.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx

from loadtest.sse import DONE_SENTINEL, SSEParser
from loadtest.workloads import RequestSpec

MAX_ERROR_CHARS = 2000  # keep result files small even if a server returns an HTML page


@dataclass(slots=True)
class RequestRecord:
    """What one request measured. Serialized as-is into the result JSON's ``requests``.

    ``start_s`` is relative to the start of the sweep point; every other time is relative to
    this request's send time. ``chunk_times_s`` holds one entry per content chunk.
    """

    index: int
    prompt_len: int
    max_tokens: int
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    output_tokens_source: str = "chunks"  # "usage" or "chunks"
    prompt_tokens: int | None = None  # from usage, when the server reports it
    finish_reason: str | None = None
    status_code: int | None = None
    error: str | None = None
    cancelled: bool = False
    cancel_reason: str | None = None  # "client" (planned hang-up) or "time_limit"

    @property
    def ok(self) -> bool:
        """Completed normally: no error and not cancelled."""
        return self.error is None and not self.cancelled

    @classmethod
    def for_spec(cls, spec: RequestSpec) -> RequestRecord:
        return cls(index=spec.index, prompt_len=spec.prompt_len, max_tokens=spec.max_tokens)


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How requests are sent.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
        model: the ``model`` field of every request.
        api_key: sent as ``Authorization: Bearer ...`` when set.
        ignore_eos: send ``ignore_eos: true`` (vLLM, pagedserve, llama.cpp accept it).
        temperature: sampling temperature (0 = greedy, the reproducible choice).
        extra_body: merged into every request body last (server-specific knobs).
        timeout_s: longest wait for the connection or for the next chunk.
    """

    base_url: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0


def http_client(base_url: str, timeout_s: float, api_key: str | None = None) -> httpx.AsyncClient:
    """An httpx client suited to load generation.

    No connection cap (httpx's default of 100 would silently queue requests inside the client
    and show up as server latency), and ``trust_env=False`` so a proxy set in the environment
    never sits between the load generator and the server.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        trust_env=False,
    )


async def _drain(chunks: AsyncIterator[bytes], timeout_s: float = 2.0) -> None:
    """Read what follows ``[DONE]`` (normally just the end of the chunked body).

    Reading the response to its end lets httpx return the connection to the pool instead of
    closing it, so the server does not see every finished request as a client disconnect. A
    server that keeps the response open after ``[DONE]`` only costs ``timeout_s``.
    """

    async def consume() -> None:
        async for _ in chunks:
            pass

    try:
        await asyncio.wait_for(consume(), timeout=timeout_s)
    except (asyncio.TimeoutError, httpx.HTTPError):
        pass


class CompletionClient:
    """Sends streaming completions and fills :class:`RequestRecord` s."""

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self._http = http_client(options.base_url, options.timeout_s, options.api_key)

    @property
    def http(self) -> httpx.AsyncClient:
        """The underlying connection pool (for probes that share it)."""
        return self._http

    async def __aenter__(self) -> CompletionClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._http.aclose()

    def request_body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.options.model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": self.options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.options.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.options.extra_body)
        return body

    async def stream_completion(
        self, spec: RequestSpec, record: RequestRecord, origin: float
    ) -> None:
        """Send ``spec`` and fill ``record`` in place.

        The record is filled in place (rather than returned) so that a request cancelled by the
        runner's time limit still leaves what it measured: on ``CancelledError`` the record is
        marked ``cancel_reason="time_limit"`` and the error is re-raised.

        Args:
            spec: the request.
            record: where measurements go (``RequestRecord.for_spec(spec)``).
            origin: ``perf_counter()`` at the start of the sweep point (for ``start_s``).
        """
        body = self.request_body(spec)
        sent = time.perf_counter()
        record.start_s = sent - origin
        try:
            await self._stream(spec, body, record, sent)
        except asyncio.CancelledError:
            record.cancelled = True
            record.cancel_reason = record.cancel_reason or "time_limit"
            raise
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        finally:
            # Runs on every path, cancellation included, so partial measurements survive.
            if record.e2e_s is None:
                record.e2e_s = time.perf_counter() - sent
            if record.chunk_times_s:
                record.ttft_s = record.chunk_times_s[0]
            if record.output_tokens_source != "usage":
                record.output_tokens = len(record.chunk_times_s)

    async def _stream(
        self, spec: RequestSpec, body: dict[str, Any], record: RequestRecord, sent: float
    ) -> None:
        parser = SSEParser()
        done = False
        async with self._http.stream("POST", "/v1/completions", json=body) as response:
            record.status_code = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", errors="replace")
                record.error = f"HTTP {response.status_code}: {text}"[:MAX_ERROR_CHARS]
                return
            chunks = response.aiter_bytes()
            async for chunk in chunks:
                now = time.perf_counter() - sent
                for event in parser.feed(chunk):
                    if event.data.strip() == DONE_SENTINEL:
                        done = True
                        break
                    if not self._handle_event(event.data, now, record):
                        return  # error event or bad JSON: recorded already
                if done:
                    break
                if (
                    spec.cancel_after_chunks is not None
                    and len(record.chunk_times_s) >= spec.cancel_after_chunks
                ):
                    # Leaving the `async with` closes the connection mid-stream: to the server
                    # this is a client disconnect, which it should turn into an abort.
                    record.cancelled = True
                    record.cancel_reason = "client"
                    record.e2e_s = time.perf_counter() - sent
                    return
            if done:
                record.e2e_s = time.perf_counter() - sent
                await _drain(chunks)
                return
            for event in parser.close():
                if event.data.strip() == DONE_SENTINEL:
                    done = True
                elif not self._handle_event(event.data, time.perf_counter() - sent, record):
                    return
        record.e2e_s = time.perf_counter() - sent
        if not done and record.finish_reason is None:
            record.error = "stream ended without [DONE] or a finish_reason"

    @staticmethod
    def _handle_event(data: str, now: float, record: RequestRecord) -> bool:
        """Apply one SSE event to the record. Returns False if it ended the request."""
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            record.error = f"bad JSON in SSE event: {data!r}"[:MAX_ERROR_CHARS]
            return False
        if not isinstance(obj, dict):
            record.error = f"unexpected SSE payload: {data!r}"[:MAX_ERROR_CHARS]
            return False
        if obj.get("error") is not None:
            record.error = f"error event: {json.dumps(obj['error'])}"[:MAX_ERROR_CHARS]
            return False
        choices = obj.get("choices") or []
        is_content = False
        for choice in choices:
            text = choice.get("text") or ""
            finish = choice.get("finish_reason")
            if finish is not None:
                record.finish_reason = str(finish)
            # A chunk with no text that only carries the finish reason is a terminal marker,
            # not a token; an empty-text chunk mid-stream is still one step's output.
            if text or finish is None:
                is_content = True
        if is_content:
            record.chunk_times_s.append(now)
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            record.output_tokens = int(usage["completion_tokens"])
            record.output_tokens_source = "usage"
            if usage.get("prompt_tokens") is not None:
                record.prompt_tokens = int(usage["prompt_tokens"])
        return True
