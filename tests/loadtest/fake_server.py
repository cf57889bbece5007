"""A tiny OpenAI-compatible server that simulates a step-based engine, for loadtest's tests.

It streams ``/v1/completions`` like vLLM does (SSE chunks, a finish chunk, a usage chunk when
``stream_options.include_usage`` is set, ``data: [DONE]``), and emits tokens from a simulated
step loop so the three batching policies behave as their real counterparts would:

- ``continuous``: every step, admit waiting requests up to ``max_num_seqs``;
- ``static``: admit up to ``max_num_seqs`` only when the running batch is empty, and keep
  the batch until its longest request finishes;
- ``dynamic``: like static, but form a batch only when ``max_num_seqs`` wait or the oldest
  has waited ``batch_wait_s``.

Every running request gets one token per step (a GPU-like constant step time). It also serves
``/health``, ``/v1/models``, ``/metrics`` and, optionally, a vLLM-style ``/tokenize``; and it
can fail every k-th request with an OpenAI-shaped 400. Run it in-process (``FakeServer``, in a
thread) or as a script (``python tests/loadtest/fake_server.py --port P --batching static``),
which is how the ``compare`` test launches it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

MODEL_ID = "fake-model"
EOS_AFTER = 3  # without ignore_eos, every request "hits EOS" after this many tokens


@dataclass
class FakeConfig:
    batching: str = "continuous"
    max_num_seqs: int = 16
    step_s: float = 0.002
    batch_wait_s: float = 0.05
    fail_every: int = 0  # every k-th completion request gets a 400 (0: never)
    tokens_per_word: float | None = None  # None: no /tokenize route
    metrics: bool = True


@dataclass
class _Sequence:
    num_tokens: int  # tokens still to emit
    arrived: float
    queue: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    aborted: bool = False


@dataclass
class FakeState:
    """What the server saw, for tests to assert on."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    max_running: int = 0
    num_disconnects: int = 0
    num_finished: int = 0


class _Engine:
    """The simulated step loop (one asyncio task)."""

    def __init__(self, config: FakeConfig, state: FakeState) -> None:
        self.config = config
        self.state = state
        self.waiting: collections.deque[_Sequence] = collections.deque()
        self.running: list[_Sequence] = []
        self.wake = asyncio.Event()

    def add(self, seq: _Sequence) -> None:
        self.waiting.append(seq)
        self.wake.set()

    def _admit(self) -> None:
        cfg = self.config
        if cfg.batching == "continuous":
            room = cfg.max_num_seqs - len(self.running)
        elif self.running:
            room = 0  # static/dynamic: never admit into a running batch
        elif cfg.batching == "dynamic" and self.waiting:
            full = len(self.waiting) >= cfg.max_num_seqs
            expired = time.monotonic() - self.waiting[0].arrived >= cfg.batch_wait_s
            room = cfg.max_num_seqs if full or expired else 0
        else:
            room = cfg.max_num_seqs
        while room > 0 and self.waiting:
            seq = self.waiting.popleft()
            if not seq.aborted:
                self.running.append(seq)
                room -= 1

    async def loop(self) -> None:
        while True:
            self._admit()
            self.state.max_running = max(self.state.max_running, len(self.running))
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()  # idle: no busy loop on a shared machine
                continue
            for seq in self.running:
                if seq.num_tokens > 0 and not seq.aborted:
                    seq.num_tokens -= 1
                    seq.queue.put_nowait(1)
                    if seq.num_tokens == 0:
                        seq.queue.put_nowait(None)
            if self.config.batching == "continuous":
                self.running = [s for s in self.running if s.num_tokens > 0 and not s.aborted]
            elif all(s.num_tokens == 0 or s.aborted for s in self.running):
                self.running = []  # the batch ends only when its longest request does
            await asyncio.sleep(self.config.step_s)


def create_app(config: FakeConfig, state: FakeState) -> FastAPI:
    engine_box: dict[str, _Engine] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = _Engine(config, state)
        engine_box["engine"] = engine
        task = asyncio.create_task(engine.loop())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        if not config.metrics:
            return Response(status_code=404)
        text = (
            "# HELP fake_finished_total finished requests\n"
            "# TYPE fake_finished_total counter\n"
            f"fake_finished_total {state.num_finished}\n"
            f'fake_latency_bucket{{le="+Inf",model="a b"}} {state.num_finished}\n'
        )
        return PlainTextResponse(text)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        if config.tokens_per_word is None:
            return JSONResponse({"error": {"message": "no tokenizer"}}, status_code=404)
        body = await request.json()
        # +1 for a BOS token, which calibration must see through.
        count = round(len(body["prompt"].split()) * config.tokens_per_word) + 1
        return JSONResponse({"count": count, "tokens": list(range(count)), "max_model_len": 4096})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        state.bodies.append(body)
        if config.fail_every and len(state.bodies) % config.fail_every == 0:
            error = {
                "message": "injected failure",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
            return JSONResponse({"error": error}, status_code=400)
        max_tokens = int(body.get("max_tokens", 16))
        num_tokens = max_tokens if body.get("ignore_eos") else min(max_tokens, EOS_AFTER)
        finish = "length" if num_tokens == max_tokens else "stop"
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        prompt_tokens = len(str(body["prompt"]).split())
        seq = _Sequence(num_tokens=num_tokens, arrived=time.monotonic())
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        engine_box["engine"].add(seq)

        async def stream() -> AsyncIterator[str]:
            emitted = 0
            live = True
            try:
                while (item := await seq.queue.get()) is not None:
                    emitted += item
                    choice = {
                        "index": 0,
                        "text": f" w{emitted}",
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    chunk = {"object": "text_completion", "choices": [choice]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield (
                    "data: "
                    + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": finish}]})
                    + "\n\n"
                )
                if include_usage:
                    usage = {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": emitted,
                        "total_tokens": prompt_tokens + emitted,
                    }
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                # NOTE: leave the in-flight count before [DONE] goes out: a closed-loop client
                # sends its next request only after reading [DONE].
                state.in_flight -= 1
                live = False
                state.num_finished += 1
                yield "data: [DONE]\n\n"
            finally:
                if live:
                    state.in_flight -= 1
                    state.num_disconnects += 1
                    seq.aborted = True

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


class FakeServer:
    """Runs the fake server with uvicorn in a background thread on 127.0.0.1."""

    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.state = FakeState()
        # NOTE: proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say
        # so, and accepted sockets inherit it. With proto 0, Nagle's algorithm meets delayed
        # ACKs and small SSE chunks arrive ~40 ms late, in bursts.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        uv_config = uvicorn.Config(
            create_app(self.config, self.state), log_level="warning", lifespan="on"
        )
        self._server = uvicorn.Server(uv_config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10.0)
        self._sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--batching", default="continuous", choices=["continuous", "static", "dynamic"]
    )
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--batch-wait-ms", type=float, default=50.0)
    parser.add_argument("--fail-every", type=int, default=0)
    args = parser.parse_args()
    config = FakeConfig(
        batching=args.batching,
        max_num_seqs=args.max_num_seqs,
        step_s=args.step_ms / 1000.0,
        batch_wait_s=args.batch_wait_ms / 1000.0,
        fail_every=args.fail_every,
    )
    uvicorn.run(
        create_app(config, FakeState()), host=args.host, port=args.port, log_level="warning"
    )


if __name__ == "__main__":
    main()
