"""Connections bounded in count and in time: what a slow, stalled or hostile client may hold.

uvicorn (h11) bounds an idle keep-alive connection (``timeout_keep_alive``) but nothing else:
a client that sends a byte of its headers every few seconds (slowloris), or that stops
reading a response, holds its socket for as long as it likes, and enough of them exhaust the
file descriptors, after which asyncio logs every failed ``accept()``. ``BoundedH11Protocol``
is uvicorn's own protocol with these bounds added::

    connection opens ──> over --max-connections? ──yes──> the oldest connection still sending
           │ no            its request's headers (a slowloris, most likely) gets 503
           │               too_many_connections and is closed, making room; if none is (every
           │               connection has a request in the app, or idles between requests),
           │               the new one gets that 503, closed once its request is read (at
           ▼               most 1 s later)
    request read timer (--header-timeout), armed on opening and on a new request's first
    byte ──> headers and body all arrived: disarmed
          ──> fired before that: 408 request_read_timeout (or, once the app has the request,
              a disconnect it sees), connection closed
    response: the transport pauses its writer when its buffer and the socket's (bounded at
    SEND_BUFFER_BYTES) are full, i.e. the client stopped reading
          ──> stall timer (--stream-send-timeout) ──> writer resumed: disarmed
                                                  ──> fired: connection aborted; the app sees
                                                      a disconnect, which aborts the engine
                                                      request (server/streaming.py)

Displacing the oldest header reader rather than refusing the newcomer keeps a liveness probe
or an ordinary client answered while slow connections hold every slot: their requests are
not in the app yet, so closing one costs no work done, and a slowloris cannot hold a slot
past the next newcomer. An idle kept-alive connection is not displaced (uvicorn closes it
after ``timeout_keep_alive``, 5 s), nor one whose request the app holds.

``AcceptErrorLog`` replaces asyncio's log line per failed ``accept()`` with one line per
interval and a count: out of file descriptors, Python's selector loop goes on calling
``accept()`` up to the listen backlog times per tick, logging each failure with a traceback
(hundreds of MB of log a minute). It also shortens the loop's pause after such a failure, so
descriptors freed meanwhile are used at once. ``raise_fd_limit`` lifts the soft
``RLIMIT_NOFILE`` to the hard one at start.
"""

from __future__ import annotations

import asyncio
import asyncio.constants as asyncio_constants
import http
import json
import logging
import os
import resource
import socket
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import TIMEOUT, UNAVAILABLE, APIError

logger = logging.getLogger(__name__)

ACCEPT_ERROR_MESSAGE = "socket.accept() out of system resource"
REJECT_LINGER_S = 1.0  # how long a refused connection stays open for its client to read the 503
# The kernel's send buffer per connection (Linux doubles it). Left to autotuning it grows to
# tcp_wmem's maximum (4 MiB by default), which a client that stops reading keeps filled, and
# the stall (the transport pausing its writer) shows only once all of it is full. 128 KiB
# still carries 2.5 MB/s at a 100 ms round trip, far above any token stream.
SEND_BUFFER_BYTES = 128 * 1024
ACCEPT_RETRY_DELAY_S = 0.1  # after accept() failed for want of fds
LOG_INTERVAL_S = 10.0  # at most one line per kind of event per interval


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    stream_send_timeout_s: float


class RateLimitedLog:
    """One warning line per ``interval_s`` at most, carrying how many events it stands for."""

    def __init__(self, what: str, interval_s: float = LOG_INTERVAL_S) -> None:
        self.what = what
        self.interval_s = interval_s
        self.num_events = 0  # since the process started
        self._num_unlogged = 0
        self._last_logged = -float("inf")

    def note(self, detail: str) -> None:
        self.num_events += 1
        self._num_unlogged += 1
        now = time.monotonic()
        if now - self._last_logged < self.interval_s:
            return
        if self._last_logged == -float("inf"):
            logger.warning(
                "%s (%s); more are counted and logged at most once per %g s",
                self.what,
                detail,
                self.interval_s,
            )
        else:
            logger.warning(
                "%s: %d in the last %.0f s (latest: %s)",
                self.what,
                self._num_unlogged,
                now - self._last_logged,
                detail,
            )
        self._num_unlogged = 0
        self._last_logged = now


class AcceptErrorLog:
    """An event-loop exception handler that rate-limits accept() failures (EMFILE and kin)
    and passes everything else to the loop's default handler."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.log = RateLimitedLog("accept() failed, out of file descriptors or memory", interval_s)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == ACCEPT_ERROR_MESSAGE:
            self.log.note(f"{context.get('exception')}; new connections wait in the backlog")
            return
        loop.default_exception_handler(context)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.set_exception_handler(self)
        # After a failed accept() the selector loop stops accepting for this long. At its
        # default of 1 s, connections freed meanwhile sit unused while new clients wait in
        # the backlog; a failed round costs a few milliseconds with the log above.
        # typeshed declares the constant Final (an int): overriding it is the point here.
        asyncio_constants.ACCEPT_RETRY_DELAY = ACCEPT_RETRY_DELAY_S  # type: ignore[misc, assignment]


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard limit; return the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit still meets the kernel's per-process cap (fs.nr_open, 2^20).
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning(
                "could not raise the open-file limit from %d to %d: %s", soft, target, exc
            )
    return soft


def num_open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        return 64


def default_max_connections(fd_limit: int) -> int:
    """Connections the fd limit leaves room for: the limit less the fds open now and a reserve
    (files opened later, and refused connections, which hold an fd for a moment each)."""
    reserve = max(32, fd_limit // 20)
    return max(1, fd_limit - num_open_fds() - reserve)


def _raw_response(error: APIError) -> bytes:
    """A complete HTTP/1.1 response for ``error`` that closes the connection, written before
    (or without) the h11 state machine having a request to answer."""
    body = json.dumps(error.body()).encode()
    lines = [
        f"HTTP/1.1 {error.status_code} {http.HTTPStatus(error.status_code).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{k.lower()}: {v}" for k, v in (error.headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def too_many_connections(limit: int) -> APIError:
    return APIError(
        503,
        f"The server has {limit} connections open, its limit (--max-connections); retry "
        "shortly, or reuse a connection.",
        type=UNAVAILABLE,
        code="too_many_connections",
        headers={"Retry-After": "1"},
    )


def request_read_timed_out(timeout_s: float) -> APIError:
    return APIError(
        408,
        f"The request's headers and body did not arrive within {timeout_s:g} s (--header-timeout).",
        type=TIMEOUT,
        code="request_read_timeout",
    )


def bounded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with ``limits`` applied (pass it as ``http=``)."""
    read_timeouts = RateLimitedLog(
        f"connection closed: request not received within {limits.header_timeout_s:g} s"
    )
    refused = RateLimitedLog(
        f"connection refused with 503: {limits.max_connections} connections open"
    )
    displaced = RateLimitedLog(
        f"connection still sending its request headers closed with 503 to make room: "
        f"{limits.max_connections} connections open"
    )
    stalls = RateLimitedLog(
        f"connection cut off: client read nothing for {limits.stream_send_timeout_s:g} s"
    )

    class BoundedH11Protocol(H11Protocol):
        # Shared by this server's connections (the class is made per server). NOTE: a
        # connection is in _reading_headers from its read timer's arming (opening, or a
        # kept-alive request's first byte) until its headers are in; dicts keep insertion
        # order, so the first entry is the oldest.
        _reading_headers: dict[BoundedH11Protocol, None] = {}
        _num_turned_away = 0  # refused or displaced, not yet closed: not counted as open

        _read_timer: asyncio.TimerHandle | None = None
        _stall_timer: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            if len(self.connections) - self._num_turned_away > limits.max_connections:
                oldest = self._oldest_reading_headers()
                if oldest is None:
                    self._refuse()
                    return
                oldest._displace()
            self._arm_read_timer()

        def _oldest_reading_headers(self) -> BoundedH11Protocol | None:
            for connection in self._reading_headers:
                if not connection.transport.is_closing():  # one the client closed meanwhile
                    return connection
            return None

        def _turn_away(self) -> None:
            self._cancel_read_timer()
            self._refused = True
            type(self)._num_turned_away += 1

        def _displace(self) -> None:
            """Close this connection, still sending its request's headers, with a 503 to make
            room for a newer one. Every byte it sent has been read, so the close sends a FIN,
            not a reset that could destroy the 503."""
            self._turn_away()
            displaced.note(f"client {self.client}")
            self.transport.write(_raw_response(too_many_connections(limits.max_connections)))
            self.transport.close()

        def _refuse(self) -> None:
            self._turn_away()
            refused.note(f"client {self.client}")
            self.transport.write(_raw_response(too_many_connections(limits.max_connections)))
            # Half-close, and close once the request has been read (data_received) or after
            # a short linger: closing with the request unread would send a reset, which can
            # destroy the 503 before the client reads it.
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._read_timer = self.loop.call_later(REJECT_LINGER_S, self.transport.abort)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                self.transport.close()  # its request is read: the fd is free at once
                return
            if self._read_timer is None and self.conn.their_state is h11.IDLE:
                self._arm_read_timer()  # the first byte of a request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._reading_headers.pop(self, None)  # the headers are in
                if self.conn.their_state is not h11.SEND_BODY:
                    self._cancel_read_timer()  # the whole request is in (or the connection is done)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_read_timer()
            self._cancel_stall_timer()
            if self._refused:
                type(self)._num_turned_away -= 1
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall_timer is None:
                self._stall_timer = self.loop.call_later(
                    limits.stream_send_timeout_s, self._on_stall
                )

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel_stall_timer()

        def _arm_read_timer(self) -> None:
            self._read_timer = self.loop.call_later(limits.header_timeout_s, self._on_read_timeout)
            self._reading_headers[self] = None

        def _cancel_read_timer(self) -> None:
            self._reading_headers.pop(self, None)
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _cancel_stall_timer(self) -> None:
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

        def _on_read_timeout(self) -> None:
            self._read_timer = None
            self._reading_headers.pop(self, None)
            if self.transport.is_closing():
                return
            read_timeouts.note(f"client {self.client}")
            if self.cycle is None or self.cycle.response_complete:
                # No request in the app's hands: answer it here.
                self.transport.write(_raw_response(request_read_timed_out(limits.header_timeout_s)))
                self.transport.close()
            else:
                # The app waits for the body: closing hands it a disconnect.
                self.transport.abort()

        def _on_stall(self) -> None:
            self._stall_timer = None
            stalls.note(f"client {self.client}")
            # abort(), not close(): close() would wait for the unread buffer to drain.
            self.transport.abort()

    return BoundedH11Protocol
