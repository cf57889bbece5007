"""Connections bounded in count and time, against the real server (server/connections.py):
slowloris under a low file-descriptor limit, a client that stops reading its SSE stream,
and the engine's queue bounded in time (--max-queue-time, on the fake engine).

All traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.launcher import free_port
from scheduler.config import SchedulerConfig
from server.connections import AcceptErrorLog, ConnectionLimits, RateLimitedLog, bounded_protocol
from server.engine_client import DrainRate
from tests.server.server_fakes import FakeEngine
from tests.server.tiny_server import REPO, make_tiny_model_dir, tiny_server

HEADER_TIMEOUT_S = 2.0
NUM_SLOWLORIS = 300
FD_LIMIT = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-connections"))


def open_slowloris(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setblocking(False)
    sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    return sock


def get_health(sock: socket.socket) -> bytes:
    """GET /health on a kept-alive connection; the whole response."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


class Canary(threading.Thread):
    """GET /health on a fresh connection every 0.2 s: (seconds, status or error name)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.results: list[tuple[float, float, int | str]] = []  # (sent at, seconds, answer)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                answer: int | str = httpx.get(f"{self.url}/health", timeout=2.0).status_code
            except httpx.HTTPError as exc:
                answer = type(exc).__name__
            self.results.append((start, time.monotonic() - start, answer))
            self.stop.wait(0.2)


def test_slowloris_under_a_low_fd_limit(model_dir: Path, tmp_path: Path) -> None:
    """300 connections that send a header byte every 0.5 s, against a server allowed 200
    file descriptors: a canary on fresh connections gets a 200 within 2 s throughout, every
    slow connection is closed soon after the header timeout, and the log stays small. The
    server starts with a soft fd limit of half that and raises it to the hard one itself."""
    log = tmp_path / "server.log"
    wrapper = ("prlimit", f"--nofile={FD_LIMIT // 2}:{FD_LIMIT}", "--")
    with tiny_server(
        model_dir, log, "--header-timeout", str(HEADER_TIMEOUT_S), wrapper=wrapper
    ) as server:
        port = int(server.url.rsplit(":", 1)[1])
        canary = Canary(server.url)
        canary.start()
        time.sleep(0.5)
        attack_start = time.monotonic()
        open_socks = {open_slowloris(port): time.monotonic() for _ in range(NUM_SLOWLORIS)}
        first_bytes: list[bytes] = []
        closed_after: list[float] = []
        deadline = attack_start + HEADER_TIMEOUT_S + 6.0
        next_drip = time.monotonic()
        while open_socks and time.monotonic() < deadline:
            readable, _, _ = select.select(list(open_socks), [], [], 0.1)
            for sock in readable:
                try:
                    data = sock.recv(4096)
                except ConnectionResetError:
                    data = b""
                if data:
                    first_bytes.append(data)
                # Whatever it said, the server closes after it: count the socket as done.
                closed_after.append(time.monotonic() - open_socks.pop(sock))
                sock.close()
            if time.monotonic() >= next_drip:
                next_drip += 0.5
                for sock in list(open_socks):
                    try:
                        sock.send(b"X")
                    except OSError:
                        closed_after.append(time.monotonic() - open_socks.pop(sock))
                        sock.close()
        still_open = len(open_socks)
        attack_end = time.monotonic()
        for sock in open_socks:
            sock.close()
        time.sleep(1.0)  # the canary, once the attack is gone
        canary.stop.set()
        canary.join(timeout=5)
        # The server is healthy afterwards, and the read timer spares an ordinary client
        # that keeps its connection idle between requests for longer than the timeout.
        assert server.health()[0] == 200
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            assert get_health(sock).startswith(b"HTTP/1.1 200")
            time.sleep(HEADER_TIMEOUT_S + 0.5)
            assert get_health(sock).startswith(b"HTTP/1.1 200")  # the same connection
    assert still_open == 0, f"{still_open} slow connections were never closed"
    # Connections the server kept were cut at the header timeout (408); the oldest ones were
    # displaced by newer ones past its connection cap (503). None outlived the timeout by much.
    statuses = {b[:12] for b in first_bytes}
    assert statuses <= {b"HTTP/1.1 408", b"HTTP/1.1 503"}, statuses
    assert b"HTTP/1.1 408" in statuses
    for response in first_bytes:  # complete OpenAI-shaped errors that close the connection
        head, _, body = response.partition(b"\r\n\r\n")
        assert b"connection: close" in head
        code = json.loads(body)["error"]["code"]
        if response.startswith(b"HTTP/1.1 503"):
            assert code == "too_many_connections" and b"retry-after: 1" in head
        else:
            assert code == "request_read_timeout"
    assert max(closed_after) < HEADER_TIMEOUT_S + 3.0, max(closed_after)
    # The canary: always a 200 within 2 s; past the connection cap, its connection displaces
    # the oldest slow one instead of being refused.
    answers = canary.results
    assert answers, "the canary never ran"
    late = [(round(s, 2), a) for _, s, a in answers if s > 2.0 or a != 200]
    assert not late, f"canary answers late or failed: {late} of {len(answers)}"
    after = [a for t, _, a in answers if t > attack_end]
    assert after and all(a == 200 for a in after), after
    print(
        f"{len(first_bytes)} slow connections answered "
        f"({sum(b.startswith(b'HTTP/1.1 408') for b in first_bytes)} x 408), all closed within "
        f"{max(closed_after):.2f} s; canary: {len(answers)} answers, slowest "
        f"{max(s for _, s, _ in answers):.2f} s, statuses {sorted({a for *_, a in answers})}; "
        f"log {log.stat().st_size} bytes"
    )
    text = log.read_text(errors="replace")
    assert log.stat().st_size < 1_000_000, log.stat().st_size
    assert f"open-file limit {FD_LIMIT}" in text


class HoldingApp:
    """An ASGI app: ``/hold`` answers once ``release`` is set, anything else at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.num_holding = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/hold":
            self.num_holding += 1
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@contextlib.contextmanager
def bounded_uvicorn(app: Any, limits: ConnectionLimits) -> Iterator[tuple[int, Any]]:
    """uvicorn with ``limits`` on a free port, in a thread of this process; yields the port
    and the ``uvicorn.Server``."""
    import uvicorn

    port = free_port()
    # log_config=None: this process's logging stays as pytest set it.
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=bounded_protocol(limits), log_config=None,
        loop="asyncio",
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield port, server
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def read_response(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sent before closing (or within ``timeout_s``); b"" if nothing."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def test_past_the_cap_the_oldest_header_reader_makes_room() -> None:
    """--max-connections 3: a new connection displaces the oldest one still sending its
    headers (it gets the 503), so /health stays 200; when every connection is a request the
    app holds, the new connection gets the 503 itself, and the held ones finish."""
    app = HoldingApp()
    limits = ConnectionLimits(max_connections=3, header_timeout_s=30, stream_send_timeout_s=60)
    with bounded_uvicorn(app, limits) as (port, server):
        slow = []
        for victim in range(2):
            while len(slow) < victim + 3:  # the cap's worth of slow connections open
                slow.append(open_slowloris(port))
                time.sleep(0.1)  # the server takes them in this order
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            answer = read_response(slow[victim], timeout_s=5)
            assert answer.startswith(b"HTTP/1.1 503"), answer
            assert b'"too_many_connections"' in answer and b"retry-after: 1" in answer
        for newer in slow[2:]:
            assert read_response(newer, timeout_s=0.2) == b""  # still open
        for sock in slow:
            sock.close()
        deadline = time.monotonic() + 10
        while server.server_state.connections:  # the server has seen them all closed
            assert time.monotonic() < deadline, len(server.server_state.connections)
            time.sleep(0.01)

        held = []
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /hold HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            held.append(sock)
        deadline = time.monotonic() + 10
        while app.num_holding < 3:  # all three requests are in the app
            assert time.monotonic() < deadline, app.num_holding
            time.sleep(0.01)
        refused = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "too_many_connections"
        assert refused.headers["Retry-After"] == "1"
        app.release.set()
        for sock in held:
            sock.settimeout(5)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            sock.close()


def test_stalled_sse_reader_is_cut_off_and_its_request_aborted(
    model_dir: Path, tmp_path: Path
) -> None:
    """A client that stops reading its stream: once the socket buffers fill, the server cuts
    the connection after --stream-send-timeout and the engine request is aborted."""
    log = tmp_path / "server.log"
    # Two choices at a time: the engine is still busy with the later ones when the cut comes
    # (with 8 choices it had made 3,730-3,820 of their 3,840 tokens by the cut, at about
    # 1.4 s on the 2-core VM, and a slower event loop can miss it: 24 leave room).
    num_choices = 24
    flags = ["--stream-send-timeout", "1", "--max-num-seqs", "2", "--max-n", str(num_choices)]
    with tiny_server(model_dir, log, *flags) as server:
        port = int(server.url.rsplit(":", 1)[1])
        sock = socket.socket()
        # A small receive window keeps the kernel from buffering much of the stream for us.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        body = json.dumps(
            {
                "prompt": [10, 11, 12],
                "max_tokens": 480,
                "n": num_choices,
                "logprobs": 5,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        start = time.monotonic()
        idle = server.wait_idle(timeout_s=30)  # every KV block back, integrity checked
        freed_after = time.monotonic() - start
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        # The connection is gone: reading drains what was buffered, then ends.
        sock.settimeout(5)
        received = 0
        try:
            while chunk := sock.recv(65536):
                received += len(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        sock.close()
    assert idle["engine"]["kv_blocks_used"] == 0
    aborted = re.search(
        r'pagedserve_requests_finished_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)', metrics
    )
    assert aborted and float(aborted.group(1)) >= 1, metrics[:2000]
    generated = re.search(r"^pagedserve_generation_tokens_total\{[^}]*\} (\S+)", metrics, re.M)
    assert generated and float(generated.group(1)) < num_choices * 480
    assert freed_after < 25
    assert "client read nothing for 1 s" in log.read_text()
    assert received > 0


# ------------------------------------------------------------------------------------- queue time


def test_drain_rate_ignores_idle_time() -> None:
    rate = DrainRate(window_s=10.0, idle_gap_s=2.0, min_finished=4)
    assert rate.rate() is None
    rate.on_step(99.0, 0)
    rate.on_step(99.1, 3)
    assert rate.rate() is None  # 3 finishes in 0.1 s: too few to judge
    rate.on_step(99.2, 1)
    assert rate.rate() == pytest.approx(20.0)
    rate.on_step(99.9, 0)  # nothing for 0.7 s
    assert rate.rate() == pytest.approx(4 / 0.9)
    for i in range(200):  # 2 finishes per step, steps 0.1 s apart: 20 per second
        rate.on_step(100.0 + 0.1 * i, 2)
    assert rate.rate() == pytest.approx(20.0)  # over the last 10 s only
    rate.on_step(200.0, 1)  # after a long idle gap the window restarts
    assert rate.rate() is None


def test_a_soft_fd_limit_below_the_hard_one_is_raised_to_it() -> None:
    """A child started with a soft open-file limit of 64 under a hard one of 256: the
    server's start-up call raises the soft limit to 256 and returns it (the real server logs
    it: test_slowloris_under_a_low_fd_limit starts at half its hard limit)."""
    child = (
        "import resource; from server.connections import raise_fd_limit; "
        "print(resource.getrlimit(resource.RLIMIT_NOFILE), raise_fd_limit(), "
        "resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    done = subprocess.run(
        ["prlimit", "--nofile=64:256", "--", sys.executable, "-c", child],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["(64,", "256)", "256", "(256,", "256)"], done.stdout
    assert "could not raise" not in done.stderr


def test_rate_limited_log_counts_what_it_drops(caplog: pytest.LogCaptureFixture) -> None:
    handler = AcceptErrorLog(interval_s=60.0)
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level("WARNING", logger="server.connections"):
            for _ in range(1000):
                handler(loop, {"message": "socket.accept() out of system resource",
                               "exception": OSError(24, "Too many open files")})  # fmt: skip
    finally:
        loop.close()
    assert len(caplog.records) == 1 and handler.log.num_events == 1000
    log = RateLimitedLog("x", interval_s=0.0)
    with caplog.at_level("WARNING", logger="server.connections"):
        log.note("a")
        log.note("b")
    assert caplog.records[-1].getMessage() == "x: 1 in the last 0 s (latest: b)"


async def test_queue_time_is_bounded(serve: Any) -> None:
    """Two engine slots, 50 ms steps, 10 tokens a request (about 4 requests/s), bound 1 s:
    of a burst of 30, those admitted are served within the bound plus a step, the rest get
    503 + Retry-After; once the drain rate is known, newcomers are turned away at once."""
    step_s, bound_s = 0.05, 1.0
    engine = FakeEngine(max_num_seqs=2, step_delay_s=step_s, num_blocks=512)
    first_running: dict[str, float] = {}

    def note_running(e: FakeEngine) -> None:
        now = time.monotonic()
        for r in e.running:
            first_running.setdefault(r.request_id, now)

    engine.before_step = note_running
    s = await serve(
        engine=engine,
        scheduler=SchedulerConfig(max_num_seqs=2),
        max_queue_time_s=bound_s,
        max_waiting_requests=64,
    )

    async def one() -> tuple[float, httpx.Response]:
        sent = time.monotonic()
        r = await s.http.post(
            "/v1/completions",
            json={"prompt": "hello", "max_tokens": 10, "temperature": 0, "ignore_eos": True},
        )
        return sent, r

    results = await asyncio.gather(*(one() for _ in range(30)))
    served = [(sent, r) for sent, r in results if r.status_code == 200]
    refused = [r for _, r in results if r.status_code != 200]
    assert served and refused
    for sent, r in served:
        # Seen running at the start of the step after it was admitted: one step late at most.
        waited = first_running[r.json()["id"] + "-0"] - sent
        assert waited <= bound_s + 2 * step_s + 0.1, waited
    for r in refused:
        assert r.status_code == 503
        assert r.json()["error"]["code"] in ("queue_timeout", "queue_too_long"), r.json()
        assert int(r.headers["Retry-After"]) >= 1

    # A backlog again, now with a measured drain rate: the surplus is refused up front.
    # Once the aborted ones are gone, two more fit the free slots and are served.
    await s.wait_idle()
    assert all(r.status_code == 200 for _, r in await asyncio.gather(one(), one()))
    assert s.client.drain_rate.rate() is not None
    tasks = [asyncio.create_task(one()) for _ in range(20)]
    second = await asyncio.gather(*tasks)
    codes = [r.json()["error"]["code"] for _, r in second if r.status_code == 503]
    assert "queue_too_long" in codes, codes
    await s.wait_idle()


async def test_the_queue_bound_keeps_throughput(serve: Any) -> None:
    """3x overload, open loop, for 3 s: with --max-queue-time the engine stays as busy as
    without it (>= 0.95x the slots filled per step, the throughput a step's fixed cost
    allows, which CPU contention cannot skew), while the admitted requests' wait stays
    bounded and the unbounded queue's grows past the bound."""
    step_s, bound_s, duration_s = 0.04, 0.6, 3.0
    max_tokens = 5  # 0.2 s a request on 2 slots: 10 requests/s of capacity
    rate = 30.0  # arrivals per second: 3x capacity

    async def run(max_queue_time_s: float | None) -> tuple[float, list[float]]:
        engine = FakeEngine(max_num_seqs=2, step_delay_s=step_s, num_blocks=4096)
        steps: list[tuple[float, int]] = []  # (time, requests running) of every step
        first_running: dict[str, float] = {}

        def note(e: FakeEngine) -> None:
            now = time.monotonic()
            steps.append((now, len(e.running)))
            for r in e.running:
                first_running.setdefault(r.request_id, now)

        engine.before_step = note
        s = await serve(
            engine=engine,
            scheduler=SchedulerConfig(max_num_seqs=2),
            max_queue_time_s=max_queue_time_s,
            max_waiting_requests=1000,
        )
        waits: list[float] = []

        async def one() -> None:
            sent = time.monotonic()
            r = await s.http.post(
                "/v1/completions",
                json={"prompt": "hi", "max_tokens": max_tokens, "temperature": 0},
            )
            if r.status_code == 200:
                waits.append(first_running[r.json()["id"] + "-0"] - sent)

        start = time.monotonic()
        tasks = []
        while time.monotonic() - start < duration_s:
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(1 / rate)
        end = time.monotonic()
        await asyncio.sleep(0.5)  # what was admitted in time gets served
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await s.wait_idle(timeout_s=10)
        in_window = [n for t, n in steps if start + 0.5 <= t <= end]
        return sum(in_window) / (2 * len(in_window)), waits

    bounded_busy, bounded_waits = await run(bound_s)
    unbounded_busy, unbounded_waits = await run(None)
    assert bounded_busy >= 0.95 * unbounded_busy, (bounded_busy, unbounded_busy)
    assert max(bounded_waits) <= bound_s + 2 * step_s + 0.1, max(bounded_waits)
    assert max(unbounded_waits) > bound_s  # the same load without the bound queues longer


def test_the_bound_flags_reach_the_config() -> None:
    from server.config import ServingConfig

    c = ServingConfig.from_cli(
        [
            "--header-timeout", "5", "--max-connections", "100", "--stream-send-timeout",
            "7", "--max-queue-time", "30", "--allow-special-tokens-in-content",
        ],
        {},
    )  # fmt: skip
    server = c.server
    assert (server.header_timeout_s, server.max_connections, server.stream_send_timeout_s) == (
        5.0,
        100,
        7.0,
    )
    assert server.max_queue_time_s == 30.0 and server.allow_special_tokens_in_content
    defaults = ServingConfig.from_cli([], {}).server
    assert defaults.max_queue_time_s is None and defaults.max_connections is None
    assert not defaults.allow_special_tokens_in_content
    for bad in (["--header-timeout", "0"], ["--max-queue-time", "-1"], ["--max-connections", "0"]):
        with pytest.raises(SystemExit) as exc:
            ServingConfig.from_cli(bad, {})
        assert exc.value.code == 2
