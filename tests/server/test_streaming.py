"""SSE framing byte for byte, usage chunks, in-band errors, and disconnect -> abort.

Disconnects are driven through the raw ASGI interface: the test's ``receive`` hands over the
body and later reports ``http.disconnect``, exactly as uvicorn does when a socket closes.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from typing import Any

import pytest

from server.streaming import DONE_FRAME, sse_frame
from tests.server.server_fakes import FakeEngine

FRAME = re.compile(rb"data: (\{.*?\}|\[DONE\])\n\n", re.S)


def split_frames(raw: bytes) -> list[bytes]:
    """Split an SSE body into frames, asserting nothing else is in between."""
    frames = [m.group(0) for m in FRAME.finditer(raw)]
    assert b"".join(frames) == raw, "the body must be nothing but data: frames"
    return frames


async def test_completion_stream_framing_is_byte_exact(serve) -> None:
    s = await serve()
    r = await s.http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0, "stream": True}
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = split_frames(r.content)
    assert frames[-1] == DONE_FRAME == b"data: [DONE]\n\n"
    chunks = [json.loads(f[6:]) for f in frames[:-1]]
    for raw, chunk in zip(frames[:-1], chunks, strict=True):
        # compact JSON, the same bytes json.dumps would write, no "usage" unless asked for
        assert (
            raw
            == b"data: "
            + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()
            + b"\n\n"
        )
        assert "usage" not in chunk
        assert chunk["object"] == "text_completion"
        assert set(chunk) == {"id", "object", "created", "model", "choices"}
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert chunks[-1]["choices"][0]["text"] == ""


async def test_include_usage_adds_null_usage_and_a_final_usage_chunk(serve) -> None:
    s = await serve()
    r = await s.http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = [json.loads(f[6:]) for f in split_frames(r.content)[:-1]]
    *body, last = chunks
    assert all("usage" in c and c["usage"] is None for c in body)
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 8
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 8
    # OpenAI's chat sequence per choice: role first, content, then an empty delta + reason.
    for index in (0, 1):
        mine = [c["choices"][0] for c in body if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all(set(m["delta"]) == {"content"} for m in mine[1:-1])
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(serve, path) -> None:
    """Each chunk carries its choice's usage so far (its prompt's tokens and its own output,
    as vLLM fills them); the last chunk, without choices, the request's."""
    s = await serve()
    tok = s.engine.tokenizer
    prompts = ["hi", "a longer prompt here"]
    if path == "/v1/completions":
        prompt: dict = {"prompt": prompts}
        lengths = [len(tok.encode(p)) for p in prompts]
    else:
        prompt = {"messages": [{"role": "user", "content": "hi"}]}
        lengths = [None]
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**prompt, "n": 2, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": options}  # fmt: skip
    r = await s.http.post(path, json=body)
    *chunks, last = [json.loads(f[6:]) for f in split_frames(r.content)[:-1]]
    seen: dict[int, list[int]] = {}
    for c in chunks:
        (choice,) = c["choices"]
        usage = c["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        want_prompt = lengths[choice["index"] // 2]
        assert want_prompt is None or usage["prompt_tokens"] == want_prompt
        seen.setdefault(choice["index"], []).append(usage["completion_tokens"])
    num_choices = 2 * len(lengths)
    assert sorted(seen) == list(range(num_choices))
    assert all(counts == sorted(counts) and counts[-1] == 4 for counts in seen.values())
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4 * num_choices
    # Without include_usage it is off, as vLLM has it.
    body["stream_options"] = {"continuous_usage_stats": True}
    r = await s.http.post(path, json=body)
    assert all("usage" not in json.loads(f[6:]) for f in split_frames(r.content)[:-1])


async def test_engine_failure_mid_stream_is_reported_in_band(serve) -> None:
    engine = FakeEngine(step_delay_s=0.01)
    s = await serve(engine)

    def fail_on_third(e: FakeEngine) -> None:
        if e.num_steps == 3:
            e.fail_next_step = RuntimeError("kaboom")
            e.before_step = None

    engine.before_step = fail_on_third
    r = await s.http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 50, "stream": True}
    )
    frames = split_frames(r.content)
    assert frames[-1] == DONE_FRAME
    error = json.loads(frames[-2][6:])
    assert set(error) == {"error"} and "kaboom" in error["error"]["message"]
    assert error["error"]["type"] == "server_error"
    await s.wait_idle()


async def test_engine_failure_non_streaming_is_a_500(serve) -> None:
    engine = FakeEngine(step_delay_s=0.01)
    s = await serve(engine)

    def fail_once(e: FakeEngine) -> None:
        if e.num_steps == 2:
            e.fail_next_step = RuntimeError("kaboom")
            e.before_step = None

    engine.before_step = fail_once
    r = await s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_error"
    ok = await s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


async def call_asgi(app: Any, path: str, body: dict, disconnect_after_s: float) -> list[dict]:
    """POST ``body`` through the ASGI app; the client hangs up after ``disconnect_after_s``."""
    payload = json.dumps(body).encode()
    sent: list[dict] = []
    delivered = False
    gone = asyncio.Event()

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"host", b"test"),
            (b"content-length", str(len(payload)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
    }
    loop = asyncio.get_running_loop()
    loop.call_later(disconnect_after_s, gone.set)
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    return sent


async def test_non_streaming_disconnect_aborts_the_engine_request(serve) -> None:
    engine = FakeEngine(step_delay_s=0.01, max_model_len=100_000, num_blocks=100_000)
    s = await serve(engine)
    started = asyncio.get_running_loop().time()
    sent = await call_asgi(
        s.app, "/v1/completions", {"prompt": "hi", "max_tokens": 50_000}, disconnect_after_s=0.2
    )
    assert asyncio.get_running_loop().time() - started < 3, "must not run to max_tokens"
    assert sent[0]["status"] == 499
    await s.wait_idle()
    assert len(engine.aborted) == 1


async def test_streaming_disconnect_aborts_the_engine_request(serve) -> None:
    engine = FakeEngine(step_delay_s=0.01, max_model_len=100_000, num_blocks=100_000)
    s = await serve(engine)
    sent = await call_asgi(
        s.app,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "n": 3, "stream": True},
        disconnect_after_s=0.2,
    )
    assert sent[0]["status"] == 200
    assert any(m.get("body", b"").startswith(b"data: ") for m in sent[1:])
    await s.wait_idle()
    assert len(engine.aborted) == 3


async def test_disconnect_while_queued_aborts_before_any_token(serve) -> None:
    # One slot, taken by a long request: the second waits in the engine's queue.
    engine = FakeEngine(
        step_delay_s=0.01, max_num_seqs=1, max_model_len=100_000, num_blocks=100_000
    )
    s = await serve(engine)
    hog = asyncio.create_task(
        s.http.post("/v1/completions", json={"prompt": "a", "max_tokens": 60})
    )
    await asyncio.sleep(0.05)
    sent = await call_asgi(
        s.app, "/v1/completions", {"prompt": "b", "max_tokens": 10}, disconnect_after_s=0.1
    )
    assert sent[0]["status"] == 499
    assert (await hog).status_code == 200
    await s.wait_idle()
    assert len(engine.aborted) == 1


def test_sse_frame_usage_field() -> None:
    assert sse_frame({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse_frame({"a": 1}, usage_field=True) == b'data: {"a":1,"usage":null}\n\n'
    assert sse_frame({"t": "日本"}) == 'data: {"t":"日本"}\n\n'.encode()


WARM_CHILD = """
import asyncio, sys
from scheduler.config import SchedulerConfig
from server.api import create_app
from server.config import ServerConfig, ServingConfig
from server.engine_client import AsyncEngineClient
from tests.server.server_fakes import FakeEngine

async def main():
    config = ServingConfig(scheduler=SchedulerConfig(), server=ServerConfig(stats_log_interval_s=0))
    app = create_app(config, AsyncEngineClient(FakeEngine(), idle_wake_s=0.05))
    assert "anyio._backends._asyncio" not in sys.modules, "imported before start-up"
    async with app.router.lifespan_context(app):
        assert "anyio._backends._asyncio" in sys.modules, "not loaded at start-up"

asyncio.run(main())
"""


def test_start_up_loads_what_the_first_streamed_response_would() -> None:
    """anyio loads its asyncio backend on first use, a streamed response's task group: the
    app's start-up does it, so the first request after /health does not pay the import."""
    done = subprocess.run([sys.executable, "-c", WARM_CHILD], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
