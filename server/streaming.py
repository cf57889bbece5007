"""SSE framing (byte-identical to OpenAI's) and client-disconnect -> engine abort.

Framing: every event is ``data: <compact JSON>\\n\\n`` and the stream ends with
``data: [DONE]\\n\\n``. Under ``stream_options.include_usage`` every chunk carries
``"usage": null`` and one last chunk with ``"choices": []`` carries the usage, as OpenAI does (with
``continuous_usage_stats``, every chunk carries the usage so far, as vLLM does).
An error after the response started (the engine failed) is sent as one
``data: {"error": {...}}`` event followed by ``[DONE]``, because the status line is gone.

Disconnects: Starlette cancels a *streaming* response when the client goes away, but not a
plain JSON one, which would keep generating up to max_tokens (vLLM#9428, ROCm/ATOM#1562). So
both kinds run under ``abort_on_disconnect``: a task waits for ``http.disconnect`` and aborts
the engine requests; the engine then finishes them as "abort" and frees their blocks within
one step, and the handler unwinds normally.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from server.errors import APIError

if TYPE_CHECKING:
    from server.generation import ChoiceDelta, GenerationRun

logger = logging.getLogger(__name__)


def stream_usage(options: Any) -> tuple[bool, bool]:
    """A request's ``stream_options`` as (usage in a last chunk, usage so far in every chunk
    too: vLLM's ``continuous_usage_stats``, which needs ``include_usage``)."""
    include = bool(options is not None and options.include_usage)
    return include, include and bool(options.continuous_usage_stats)


DONE_FRAME = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell nginx-style proxies not to buffer the stream
}


def sse_frame(payload: BaseModel | dict[str, Any], *, usage_field: bool = False) -> bytes:
    """One ``data:`` event. ``usage_field`` adds ``"usage": null`` when the chunk has none."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    if usage_field:
        data.setdefault("usage", None)
    return (
        b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


def sse_error_frame(error: APIError) -> bytes:
    return sse_frame(error.body())


def sse_response(frames: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has disconnected (the request body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@contextlib.asynccontextmanager
async def abort_on_disconnect(
    request: Request, on_disconnect: Callable[[], None], on_exit: Callable[[], None]
) -> AsyncIterator[None]:
    """Run the body while watching for a disconnect.

    ``on_disconnect`` runs when the client goes away; ``on_exit`` always runs at the end
    (normal end, error or cancellation), so nothing keeps running in the engine.
    """

    async def watch() -> None:
        await wait_for_disconnect(request)
        logger.info("client disconnected from %s; aborting its request", request.url.path)
        on_disconnect()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        on_exit()


async def run_to_end(request: Request, run: GenerationRun) -> bool:
    """Drive a non-streaming run to its end. Returns False if the client went away."""
    async with abort_on_disconnect(request, run.abort, run.close):
        async for _ in run.deltas():
            pass
    return not run.aborted


async def stream_run(
    request: Request,
    run: GenerationRun,
    opening: Callable[[], Iterable[bytes]],
    delta_frames: Callable[[ChoiceDelta], Iterable[bytes]],
    usage_frame: Callable[[], bytes] | None,
) -> AsyncIterator[bytes]:
    """The SSE body of a run: ``opening()`` frames, each delta's frames, the usage frame
    (unless the client went away), then ``[DONE]``. The endpoint decides the chunk shapes.

    An engine failure after the headers went out is reported in-band (``sse_error_frame``).
    """
    async with abort_on_disconnect(request, run.abort, run.close):
        try:
            for frame in opening():
                yield frame
            async for batch in run.deltas():
                for delta in batch:
                    for frame in delta_frames(delta):
                        yield frame
            if usage_frame is not None and not run.aborted:
                yield usage_frame()
        except APIError as error:
            yield sse_error_frame(error)
    yield DONE_FRAME
